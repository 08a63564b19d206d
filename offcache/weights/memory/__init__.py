"""The weights under a memory limit: where ``load_offloaded_model`` puts them (placement), whether a
subgraph fits at all (fit), which CPU weights are a checkpoint's file-backed mapping (file_backed),
and the heap that offcache's host copies leave returned to the OS (host_trim)."""
