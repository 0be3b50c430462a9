"""Keeping the worker process alive and visible: its heartbeat, the health facts it
carries (hardware, RAM, GPUs) and the consuming gate they drive, and its metrics."""
