"""The scheduler (scheduler.py), what it hands the runner each step (output.py), and its waiting queues."""
