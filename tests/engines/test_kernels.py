"""The Triton kernels against the torch maths they replace, run on the CPU by Triton's interpreter.

The interpreter is chosen when Triton is first imported, so the comparison runs in a child process
with ``TRITON_INTERPRET=1``; it prints the largest differences as JSON.

The interpreter computes a block's ``tl.dot`` with numpy, whose bits for a row can depend on the
block around it (the CPU's BLAS kernels round edge rows and split work between threads their own
way: on an AMD EPYC a row of ``linear`` moved with two BLAS threads, one of ``attend`` by 7e-6 with
one). So here a row computed alone must match the same row in a batch to within float32 rounding,
which still catches a wrong offset or mask; the bit-identical reads the batch-invariant kernels give
are checked on the GPU (``tests/gpu``, the deterministic mode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

#: how far a row alone may be from the same row in a batch under the interpreter (values of size 1-20)
ROUNDING = 5e-5

CHECKS = r"""
import json
import torch
from slotread.engines.diffusion_gemma import fused, kernels

torch.manual_seed(0)
worst = {}

# combine: 5 tokens x top-3 copies in a random expert order, 300 columns (two blocks, the second masked)
rows, weights, inverse = torch.randn(15, 300), torch.rand(15), torch.randperm(15)
worst["combine"] = (kernels.combine(rows, weights, inverse, 3) - fused.combine_torch(rows, weights, inverse, 3)).abs().max().item()
half = kernels.combine(rows.bfloat16(), weights, inverse, 3)
worst["combine_dtype"] = str(half.dtype)
worst["combine_bf16"] = (half.float() - fused.combine_torch(rows.bfloat16(), weights, inverse, 3).float()).abs().max().item()

# merge: the first part contiguous, the second a transposed view, LSEs sliced from padded storage;
# in row 0 the first part has every key masked (LSE -1e30, as an empty part gives): weight 0
first = torch.randn(3, 2, 5, 72)
first_lse = torch.randn(3, 2, 8)[..., :5]
second = torch.randn(2, 3, 5, 72).transpose(0, 1)
second_lse = torch.randn(2, 3, 5).transpose(0, 1)
first_lse[0] = -1e30
got = kernels.merge_two(first, first_lse, second, second_lse)
worst["merge"] = (got - fused.merge_two_torch(first, first_lse, second, second_lse)).abs().max().item()
worst["merge_contiguous"] = got.is_contiguous()
worst["merge_masked"] = (got[0] - second[0]).abs().max().item()

# grouped GEMM: experts with 3, 0, 20 (two row blocks) and 1 rows, 40 x 72 weights (masked tiles)
counts = torch.tensor([3, 0, 20, 1])
offsets = torch.cumsum(counts, 0).to(torch.int32)
rows, weight = torch.randn(24, 72), torch.randn(4, 40, 72)
starts = [0, *offsets[:-1].tolist()]
want = torch.cat([rows[s:e] @ weight[k].T for k, (s, e) in enumerate(zip(starts, offsets.tolist()))])
worst["grouped"] = (kernels.grouped(rows, weight, offsets) - want).abs().max().item()
worst["tiled_grouped"] = (kernels.tiled_grouped(rows, weight, offsets) - want).abs().max().item()
# expert 2's 20 rows alone (one expert, one tile): what they give among the others, where they span two tiles'
# worth of offsets
alone = kernels.tiled_grouped(rows[3:23], weight[2:3], torch.tensor([20], dtype=torch.int32))
worst["tiled_grouped_invariant"] = (alone - kernels.tiled_grouped(rows, weight, offsets)[3:23]).abs().max().item()

# linear: 70 rows (a partial row block) x 150 inputs -> 200 outputs (partial blocks); 5 rows alone give
# what they give inside the batch, where they sit at other offsets of their blocks
rows, weight = torch.randn(70, 150), torch.randn(200, 150)
batched = kernels.linear(rows, weight)
worst["linear"] = (batched - rows @ weight.T).abs().max().item()
worst["linear_invariant"] = (kernels.linear(rows[37:42], weight) - batched[37:42]).abs().max().item()

# attention: 2 rows x 2 kv heads, 40 queries, 100 keys, a bias hiding row 1's last 30 keys; row 1 alone,
# with only its 70 keys and 9 of its queries, gives what it gives in the batch
query, keys, values = torch.randn(2, 2, 40, 72), torch.randn(2, 2, 100, 72), torch.randn(2, 2, 100, 72)
bias = torch.zeros(2, 1, 1, 100)
bias[1, ..., 70:] = -1e30
out, lse = kernels.attend(query, keys, values, bias)
scores = query @ keys.transpose(-1, -2) + bias
want_lse = torch.logsumexp(scores, -1)
worst["attend"] = (out - torch.softmax(scores, -1) @ values).abs().max().item()
worst["attend_lse"] = (lse - want_lse).abs().max().item()
alone, alone_lse = kernels.attend(query[1:, :, 20:29], keys[1:, :, :70], values[1:, :, :70], None)
worst["attend_invariant"] = max(
    (alone - out[1:, :, 20:29]).abs().max().item(), (alone_lse - lse[1:, :, 20:29]).abs().max().item()
)

# attention over parts: 5 rows reading 3 prompts of 100, 37 (a view past 13 held keys, as a sliding
# layer's skip slices) and 64 keys, 2, 1 and 2 rows each; each row's output is what ``attend``
# gives it over its own part alone
held = torch.randn(1, 2, 50, 72)
part_keys = [keys[:1], held[:, :, 13:], torch.randn(1, 2, 64, 72)]
part_values = [values[:1], torch.randn(1, 2, 50, 72)[:, :, 13:], torch.randn(1, 2, 64, 72)]
rows_query = torch.randn(5, 2, 40, 72)
parts_out, parts_lse = kernels.attend_parts(rows_query, part_keys, part_values, [2, 1, 2])
firsts = [0, 2, 3]
alone = [
    kernels.attend(rows_query[r : r + 1], k, v, None)
    for k, v, first, count in zip(part_keys, part_values, firsts, [2, 1, 2])
    for r in range(first, first + count)
]
worst["attend_parts_invariant"] = max(
    (parts_out - torch.cat([o for o, _ in alone])).abs().max().item(),
    (parts_lse - torch.cat([l for _, l in alone])).abs().max().item(),
)
want = torch.softmax(rows_query[2:3] @ part_keys[1].transpose(-1, -2), -1) @ part_values[1]
worst["attend_parts"] = (parts_out[2:3] - want).abs().max().item()
print(json.dumps(worst))
"""


def test_kernels_match_the_torch_maths_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert worst["combine"] < 1e-5
    assert worst["combine_dtype"] == "torch.bfloat16"
    assert worst["combine_bf16"] < 0.05  # one bf16 rounding of the same float32 sum
    assert worst["merge"] < 1e-5
    assert worst["merge_contiguous"]
    assert worst["merge_masked"] < 1e-6
    assert worst["grouped"] < 1e-4
    assert worst["tiled_grouped"] < 1e-4
    assert worst["tiled_grouped_invariant"] < ROUNDING
    assert worst["linear"] < 1e-4
    assert worst["linear_invariant"] < ROUNDING
    assert worst["attend"] < 1e-4
    assert worst["attend_lse"] < 1e-4
    assert worst["attend_invariant"] < ROUNDING
    assert worst["attend_parts"] < 1e-4
    assert worst["attend_parts_invariant"] < ROUNDING
