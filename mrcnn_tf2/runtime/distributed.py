"""The process world of a run: one process, or N Horovod ranks started by `horovodrun` / `mpirun`.

`init_world()` returns a `World`. Under a launcher it initialises Horovod (the low-level
`horovod.tensorflow` API) and every collective goes through it; otherwise it is a single process whose
collectives return their input. Horovod is imported only under a launcher, so training, evaluation and
tests that do not need it run where it is not installed.

Keras 3 variables are not `tf.Variable`s: Horovod is handed the underlying `v.value`.
`horovod.tensorflow.keras.DistributedOptimizer` is deliberately not used: under Keras 3 it silently
skips the allreduce.
"""

import dataclasses
import os

import keras
import tensorflow as tf

# Seconds a Gloo collective waits for a peer before failing. A dead rank is noticed sooner, by its closed
# connections and by horovodrun, which stops the others; this bounds a hung (e.g. stopped) one.
DEFAULT_GLOO_TIMEOUT_SECONDS = "60"


class World:
    """size processes, this one being `rank` (0 is the chief) and `local_rank` on its machine.

    `hvd` is the `horovod.tensorflow` module, or None for a single process without Horovod.
    """

    def __init__(self, size=1, rank=0, local_rank=0, hvd=None):
        self.size, self.rank, self.local_rank, self.hvd = size, rank, local_rank, hvd

    @property
    def is_chief(self):
        """True on the process that alone writes checkpoints, logs, summaries and console progress."""
        return self.rank == 0

    def average_gradients(self, gradients):
        """Averages a gradient list over all ranks (one grouped allreduce); usable inside tf.function.

        Args:
          gradients: list of tf.Tensor (any shape, matching its variable), tf.IndexedSlices (allgathered
            by Horovod, then averaged) or None (a variable without gradient: left None).

        Returns:
          the list in the same order, each entry the mean over ranks of that entry.
        """
        if self.hvd is None:
            return gradients
        present = [i for i, g in enumerate(gradients) if g is not None]
        averaged = self.hvd.grouped_allreduce([gradients[i] for i in present], op=self.hvd.Average)
        result = list(gradients)
        for i, g in zip(present, averaged):
            result[i] = g
        return result

    def broadcast_variables(self, variables):
        """Overwrites `variables` (Keras or tf.Variables, same list on every rank) with rank 0's values."""
        if self.hvd is None:
            return
        # A Keras 3 variable wraps a tf.Variable (its `value`), which is what Horovod assigns to.
        self.hvd.broadcast_variables([v.value if isinstance(v, keras.Variable) else v for v in variables],
                                     root_rank=0)

    def max_over_ranks(self, value):
        """The largest of every rank's int `value`, on every rank (eagerly; one small allreduce under Horovod)."""
        if self.hvd is None:
            return value
        # Eager Horovod ops match across ranks by name: one name, as every rank calls this in the same order.
        return int(self.hvd.allreduce(tf.constant(value, tf.int32), op=self.hvd.Max, name="max_over_ranks"))

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank, for small picklable objects."""
        if self.hvd is None:
            return obj
        return self.hvd.broadcast_object(obj, root_rank=0)

    def allgather_object(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every rank, for small picklable objects."""
        if self.hvd is None:
            return [obj]
        return self.hvd.allgather_object(obj)


SINGLE_PROCESS = World()

# What each launcher sets in every process it starts: (launcher, rank variable, process-count variable), in
# the order they are read. horovodrun with Gloo; Open MPI's mpirun (also under `horovodrun --mpi`); the
# PMI of MPICH's and Intel MPI's launchers.
LAUNCHERS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpiexec (PMI)", "PMI_RANK", "PMI_SIZE"),
)


class LaunchError(Exception):
    """The launcher and Horovod disagree, so the run must not start: the one line says why and what to do.

    `rank` is the process's rank as the launcher numbers it; the command line prints the message on rank 0
    only, so that a refused job says it once.
    """

    def __init__(self, message, rank):
        super().__init__(message)
        self.rank = rank


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher says of this process: it is `rank` of `size`, and `size_variable` says `size`."""

    launcher: str
    rank: int
    size: int
    size_variable: str


def read_launch(environ=os.environ):
    """The `Launch` of this process according to LAUNCHERS' variables, or None outside a launcher.

    Raises LaunchError when a rank variable is set but the launcher's variables do not form a rank and a
    process count (missing count, not integers, rank outside [0, count)).
    """
    for launcher, rank_variable, size_variable in LAUNCHERS:
        if rank_variable not in environ:
            continue
        rank, size = environ[rank_variable], environ.get(size_variable)
        if size is None or not (rank.isdigit() and size.isdigit()) or int(rank) >= int(size):
            raise LaunchError(
                f"{rank_variable}={rank!r} and {size_variable}={size!r} are not a rank and a process count: "
                f"{launcher} sets both; unset {rank_variable} to run one process, or start the job with "
                "horovodrun or mpirun", rank=int(rank) if rank.isdigit() else 0)
        return Launch(launcher, int(rank), int(size), size_variable)
    return None


def init_world(environ=os.environ):
    """The World of this process: Horovod's when a launcher started several processes, else SINGLE_PROCESS.

    Raises LaunchError, before anything is written, when a launcher started N > 1 processes but Horovod does
    not form a world of those N: Horovod is not installed, or it was built without the launcher's MPI (each
    process would be rank 0 of 1, N independent trainings writing one model_dir), or the sizes differ.
    """
    launch = read_launch(environ)
    if launch is None or launch.size == 1:
        return SINGLE_PROCESS
    started = f"{launch.launcher} started {launch.size} processes ({launch.size_variable}={launch.size})"
    environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", DEFAULT_GLOO_TIMEOUT_SECONDS)
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        # Open MPI waits for messages by spinning; on CPUs that spin takes the cores TensorFlow computes on
        # (docs/DISTRIBUTED.md, "CPU-only jobs"). Read at MPI_Init, inside hvd.init().
        environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise LaunchError(f"{started} but horovod.tensorflow does not import ({err}): run `make setup`, which "
                          "builds Horovod into .venv", launch.rank) from err
    hvd.init()
    if (hvd.size(), hvd.rank()) != (launch.size, launch.rank):
        raise LaunchError(f"{started} but Horovod formed a world of {hvd.size()} (this process: launcher rank "
                          f"{launch.rank}, Horovod rank {hvd.rank()}): {_mismatch_cause(hvd, launch, environ)}",
                          launch.rank)
    # One GPU per rank: each process must see only its own, before TensorFlow first touches them.
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    return World(hvd.size(), hvd.rank(), hvd.local_rank(), hvd)


def _mismatch_cause(hvd, launch, environ):
    """Why Horovod's world differs from the launcher's, and the fix, as one clause."""
    if launch.launcher == "horovodrun":
        return "the processes did not meet at horovodrun's rendezvous; start the job with horovodrun alone"
    if not hvd.mpi_built():
        return ("this Horovod was built without MPI, so it cannot join an MPI job; install Open MPI "
                "(apt-get install openmpi-bin libopenmpi-dev) and rerun `make setup`, which rebuilds Horovod "
                "with it, or launch with `horovodrun --gloo`")
    if not hvd.mpi_enabled():
        controller = environ.get("HOROVOD_CONTROLLER")
        return (f"Horovod did not use MPI (HOROVOD_CONTROLLER={controller}); unset HOROVOD_CONTROLLER and "
                "HOROVOD_CPU_OPERATIONS under mpirun" if controller else
                "Horovod did not use MPI; launch with `horovodrun --gloo`, or rebuild Horovod with this MPI")
    return ("the launcher's MPI is not the one Horovod was built with; rerun `make setup` with this MPI's "
            "mpicxx first on PATH, which rebuilds Horovod against it")
