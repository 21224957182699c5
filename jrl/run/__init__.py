"""The run machinery: the trainer loop, checkpoints, the workdir, metric files, console output,
sample answers, and the evaluator, exporter and benchmark as libraries, with the flag parsing the
command lines (jrl/train.py, eval.py, export.py, bench.py) share. It builds on the RL core
(jrl/step.py, rollout.py, sharding.py, config/, ...) and the maths; nothing there imports it."""
