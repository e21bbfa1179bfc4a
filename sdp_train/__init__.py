"""sdp_train: the SDP runtime on torch.distributed and the ``sdp`` command line.

Importing this package imports no torch; the command line loads each subcommand lazily so that
``sdp design`` and ``sdp inspect`` stay fast and work without a GPU stack.
"""
