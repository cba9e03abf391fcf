"""Where trials run: the local bubblewrap jail and its verifier jail, per-trial caps, the verifier's report
channel, Daytona, task-directory I/O and Harbor's environment. Machinery; the paper's trial loop is rollout.py."""
