"""The sub-commands of the ``epgen`` command line (``epgen.cli`` builds the parser from them).

One module per sub-command: ``HELP`` (its line in ``epgen --help``), ``add_arguments(parser)``
and ``run(args) -> exit status``. ``common`` holds what several share (the configuration
options, variant names, output files checked before any work, ``CommandError``);
``run_options`` the options of ``epgen run``, their checks and the world they name;
``run_shmem`` the ``run --world shmem`` process. Each module imports only the standard
library at its top: the kernels, llvmlite and cuda load inside the command that needs them,
so ``epgen --help`` stays fast and works where a backend is broken.
"""
