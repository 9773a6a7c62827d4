"""A small Mixtral-style MoE trains through the patched Megatron-LM ``pretrain_gpt.py`` (HDP).

One run on 2 CPU gloo ranks (fixture ``patched_megatron_lm``, launcher of
``megatron_bytescale.testing.megatron_lm``): 4 experts, top-2, the all-to-all dispatcher,
SwiGLU, RMSNorm, RoPE, untied embeddings, the load-balancing loss and z-loss, expert
parallelism 1. Megatron's own loop runs the steps; the HDP summary line is in the log.
The gradients themselves are checked against megatron-core in ``test_moe_training.py``.
"""

from __future__ import annotations

import re

from megatron_bytescale.testing.megatron_lm import run_pretrain_gpt

from .megatron_lm_cases import random_documents, write_indexed_dataset
from .test_megatron_lm_parallel import PRETRAIN, _losses

MIXTRAL_STYLE = ["--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-token-dispatcher-type", "alltoall",
                 "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                 "--moe-z-loss-coeff", "1e-3", "--moe-ffn-hidden-size", "96",
                 "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def test_patched_pretrain_gpt_trains_a_mixtral_style_moe(patched_megatron_lm, tmp_path):
    write_indexed_dataset(tmp_path / "text_document", random_documents(7, 120, vocab=255))
    flags = [*PRETRAIN, *MIXTRAL_STYLE, "--data-path", str(tmp_path / "text_document"),
             "--split", "98,1,1"]
    run = run_pretrain_gpt(patched_megatron_lm, *flags, ranks=2, cwd=tmp_path)
    assert run.returncode == 0, run.tail()
    losses = _losses(run.stdout)
    assert len(losses) == 3 and all(x == x and 0 < x < 20 for x in losses), losses
    summaries = re.findall(r"\[ByteScale HDP\] iteration .*", run.stdout)
    assert len(summaries) == 3, run.tail()
    rings = [int(r.split("x")[0]) for line in summaries
             for r in re.search(r"\| rings ([\dx ]+) \|", line).group(1).split()]
    assert max(rings) == 2, summaries  # documents longer than the capacity ran on a ring
