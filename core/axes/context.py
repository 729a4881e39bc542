"""Context parallelism: every sequence split over ``cp`` data-parallel ranks (core/mesh.py ``Mesh.cp``,
``sequence_chunks``), each attention core meeting the rest of its sequence by a ring of key/value
exchanges or by all-to-alls that swap sequence slices for heads (runtime/cp/; priced in
passes/context.py)."""

from __future__ import annotations

from partita.core.axes.rules import Axis, Rule, carved_out_of_dp

RING, ALL_TO_ALL = "ring", "all-to-all"
# the ring sums each block's key and value gradients along the ring in this dtype, whatever the
# activations' (a partial sum passes cp - 1 ranks: runtime/cp/attention.py sends it, the planner
# prices it, passes/context.py)
RING_GRAD_DTYPE = "fp32"
CP_ATTENTION = (RING, ALL_TO_ALL)
# what each strategy sends, in words (the report's and the viewer's)
CP_SENDS = {RING: "keys and values passed around the cp group, cp - 1 exchanges per attention core, each "
                  "overlapped with a block of attention",
            ALL_TO_ALL: "four all-to-alls per attention core: q, k and v from sequence slices to heads, the "
                        "output back"}

DIVIDES_DP = carved_out_of_dp("cp", "context-parallel groups", "a",
                              " (dp counts every rank holding the same parameters)")
NO_ATTENTION = Rule(
    ("cp", "attention_core"), lambda v: v["cp"] > 1 and not v["attention_core"],
    lambda say, v: f"{say('cp')}: the model has no attention core to split the sequence around (scaled dot-product "
                   "attention, or Q K^T, softmax and P V written out, core/recompute.py)",
    "drop --cp")
SEQUENCE = Rule(
    ("cp", "sequence"), lambda v: v["cp"] > 1 and v["sequence"] % (2 * v["cp"]) != 0,
    lambda say, v: f"{say('cp')} does not split the sequence of {v['sequence']} tokens into 2 x {v['cp']} = "
                   f"{2 * v['cp']} equal chunks (each cp rank holds two, mirrored, for the causal load balance)",
    "pin a --cp whose double divides the sequence length, or give a sequence length that it divides")
HEADS = Rule(
    ("cp", "cp_attention", "heads", "tp"),
    lambda v: v["cp"] > 1 and v["cp_attention"] == ALL_TO_ALL and v["heads"] % (v["tp"] * v["cp"]) != 0,
    lambda say, v: f"{say('cp_attention')} at {say('cp')}: the attention's {v['heads']} heads"
                   + (f" ({v['heads'] // v['tp']} per rank at {say('tp')})" if v["tp"] > 1 else "")
                   + f" do not divide over {v['cp']} ranks",
    "use --cp-attention ring, or a --cp that divides the heads")
WITH_EXPERTS = Rule(
    ("cp", "ep"), lambda v: v["cp"] > 1 and v["ep"] > 1,
    lambda say, v: f"{say('cp')} with {say('ep')}: this version splits sequences or experts over the "
                   "data-parallel ranks, not both",
    "drop --cp, or drop --ep")
INFERENCE = Rule(
    ("cp", "inference"), lambda v: v["cp"] > 1 and v["inference"],
    lambda say, v: f"{say('cp')} with {say('inference')}: this version splits sequences for training only",
    "drop --cp")


def _describe(plan) -> str | None:
    m = plan.mesh
    if m.cp == 1:
        return None
    groups = m.groups("cp")
    shown = " ".join("[" + ", ".join(map(str, g)) + "]" for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
    return (f"cp = {m.cp}: each sequence split over {m.cp} data-parallel ranks ({m.samples} sample group"
            f"{'s' if m.samples != 1 else ''}), attention by {plan.training.cp_attention}; groups {shown}")


AXIS = Axis("context parallelism", ("cp", "cp_attention"),
            (DIVIDES_DP, NO_ATTENTION, SEQUENCE, HEADS, WITH_EXPERTS, INFERENCE), describe=_describe)
