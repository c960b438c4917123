"""How a net runs: the executor (batch partitions on worker threads), the
process-wide BLAS thread control, run settings, memory planning and FLOP
counts. Layers and lowering never import it."""
