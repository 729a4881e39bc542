"""The data-parallel axis's planner: gradient buckets (``buckets``) and the ZeRO stage (``zero``)."""
