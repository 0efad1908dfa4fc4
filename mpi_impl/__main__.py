"""mpiexec -n 4 python -m mpi4py -m mpi_impl --layout all --check   (see `mpi_impl.cli`)"""

import sys

from .cli import main

sys.exit(main())
