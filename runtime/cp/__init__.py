"""Context parallelism at run time: attention over a sequence split across the "cp" group."""
