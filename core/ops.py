"""Families of graph ops, by the name a node's target goes by (``"aten.addmm.default"`` ->
``"addmm"``): the one list each family lives in.

passes/flops.py counts their FLOPs (2mnk for a matmul, per output element for a
convolution, the two matmuls of attention); core/capture.py refuses inputs whose
dtype would meet another in one of them (fake tensors do not check it: a float
matmul of an int64 input would capture, then fail on the device).
"""

from __future__ import annotations

MATMUL = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"})
CONV = frozenset({"convolution", "conv1d", "conv2d", "conv3d", "_convolution", "conv_transpose1d",
                  "conv_transpose2d"})
ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"})
# ops whose tensor operands must share one dtype (a bool operand is a mask, not a value multiplied)
SAME_DTYPE = MATMUL | CONV | ATTENTION

