"""How new a split's tasks are to the training pools: instructions, command lines, templates and names.

A run's tasks come in splits by purpose (data.eval_splits draws the evaluation ones; task.toml [metadata] split names
each task's): the SFT and RL pools train; "val" makes every choice of recipe, step count or hyper-parameter; "test"
(in-template: unseen instances of the training templates) is evaluated only at the end of a run; "test_deep"
(out-of-template: RST chains of depth data.DEEP_DEPTHS, deeper than any in training, so that no template of it is
a training template) tests long-horizon transfer; "test_names" (in-template, every name and value from
families.UNSEEN, pools and shapes disjoint from training's) tests copying names the agent never saw.

A generated task's template is "family/kind" plus "+op" per RST step ("text/count+gzip+backup"; task.toml [metadata]
template, written by data.write_task); its names are the path parts of its initial /app files and of its outputs
([metadata] names). A task this project did not write (Terminal-Bench) has no template (None) and its names are the
path parts of its environment/app tree.
"""
import os

from sandbox import task_io

AUTHOR = "t1-repro data.py"  # task.toml [metadata] author_name of the tasks data.write_task writes


def _meta(task_dir, key):
    """A generated task's [metadata] key (None for a task this project did not write); a loud error when missing."""
    meta = task_io.load_task(task_dir).config.get("metadata", {})
    if meta.get("author_name") != AUTHOR:
        return None
    value = meta.get(key)
    if not value or not isinstance(value, (str, list)):
        raise ValueError(f"{task_dir}: a generated task without task.toml [metadata] {key} (written before templates "
                         "were recorded): regenerate its pool")
    return value


def template_of(task_dir):
    """The task's template ("family/kind+op..."), or None for a task this project did not write."""
    return _meta(task_dir, "template")


def names_of(task_dir) -> list:
    """The task's file / dir names (a generated task's [metadata] names; else its environment/app tree's)."""
    names = _meta(task_dir, "names")
    if names is not None:
        return list(names)
    app = os.path.join(task_io.load_task(task_dir).env_dir, "app")
    return sorted({part for root, dirs, files in os.walk(app) for n in dirs + files
                   for part in os.path.relpath(os.path.join(root, n), app).split(os.sep)})


def overlap(train_dirs, test_dirs) -> dict:
    """How new the test tasks are to a training pool: shared instructions (0 by construction), test instruction
    words and reference command lines seen in the pool's, test tasks whose every command line was seen (solvable by
    recall alone), the share of test tasks whose template is a training template (templates_shared: 1.0 for an
    in-template split, 0.0 for the out-of-template one) and the share of the test tasks' names that a training task
    has (names_seen: 0.0 for the unseen-names split)."""
    def read(d):
        t = task_io.load_task(d)
        with open(os.path.join(d, "solution", "solve.sh")) as f:
            cmds = [ln for ln in f.read().splitlines()[3:] if ln.strip()]  # after the shebang, set -e, cd /app
        return t.instruction, cmds
    train = [read(d) for d in train_dirs]
    held = [read(d) for d in test_dirs]
    words = {w for ins, _ in train for w in ins.split()}
    lines = {c for _, cmds in train for c in cmds}
    hw = [w for ins, _ in held for w in ins.split()]
    hl = [c for _, cmds in held for c in cmds]
    templates = {template_of(d) for d in train_dirs} - {None}
    names = {n for d in train_dirs for n in names_of(d)}
    test_names = [n for d in test_dirs for n in names_of(d)]
    return {"instructions_shared": len({i for i, _ in held} & {i for i, _ in train}),
            "word_seen": round(sum(w in words for w in hw) / max(1, len(hw)), 3),
            "command_line_seen": round(sum(c in lines for c in hl) / max(1, len(hl)), 3),
            "tasks_all_lines_seen": sum(all(c in lines for c in cmds) for _, cmds in held),
            "templates_shared": round(sum(template_of(d) in templates for d in test_dirs) / max(1, len(test_dirs)), 3),
            "names_seen": round(sum(n in names for n in test_names) / max(1, len(test_names)), 3)}
