"""The two front ends that feed the block pipeline: ``DistributedOptimizer`` and the DDP comm hook, with
what they share (the step driver, auto mode's uncompressed all_reduce steps, ``StepStats``)."""
