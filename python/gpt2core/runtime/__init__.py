"""This machine: the doctor (python -m gpt2core.doctor: what is installed and whether it runs) and the GPU lease
driver (calibrate: measurements in value order, each in a subprocess with its own bound)."""
