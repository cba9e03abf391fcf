"""Where trials run: the local bubblewrap jail and its verifier jail, per-trial caps, the verifier's report
channel, Daytona, task-directory I/O and Harbor's environment. Machinery; the paper's trial loop is rollout.py.

Start with jail.py (the Sandbox and its security contract: threat model, residual risks). Its parts: limits.py
(what a trial may use), seccomp.py (the BPF filter), host_fs.py (the host's file operations on untrusted trees),
procs.py (a jail's processes through /proc), terminal.py (key names, output cap), trial_caps.py (uid, disk,
memory), verifier_report.py with verifier_report_plugin.py (the report channel). daytona.py is the cloud member of
the same interface; task_io.py reads task dirs; harbor_env.py and harbor_run.py are the Harbor path.
"""
