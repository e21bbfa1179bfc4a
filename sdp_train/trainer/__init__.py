"""``sdp train``: a checked configuration, its rank processes, the training loop and its files.

`config` is the run's configuration; `prepare` checks everything before a process group
exists; `modes` builds each mode's synchronisation on the library (`sdp_train.parallel`); `run`
is one rank's model, optimizer and step; `train` is the loop; `checkpoint`, `faults`, `memory`,
`log`, `outputs` and `rundir` are what the loop writes, injects, measures and owns; `membership` is
how ranks lose and take back workers, `survivor_launcher` the launcher that keeps their processes.
"""
