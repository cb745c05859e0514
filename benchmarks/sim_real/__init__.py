"""The parts of ``benchmarks/sim_to_real.py``, by job: ``live`` measures the running cluster, ``readings`` turns
what was measured into the simulator's inputs, ``host_fit`` is the shared host's model fitted to the probes."""
