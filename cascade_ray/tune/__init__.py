"""Ray Tune sweeps of one stage, with the frozen upstream shared by every trial."""
