"""A model of an inference engine (vLLM-like), independent of any clock: the simulator steps it
in virtual time, the HTTP emulator in real time."""
