"""How a net runs: the executor (layers in batch partitions, partition.py, on
the process's worker threads and BLAS thread control, threads.py), run
settings (settings.py), the sub-task graph and the streams scheduler
(graph.py, scheduler.py), diff sharing (memory.py) and FLOP counts
(profile.py). Layers and lowering never import it."""
