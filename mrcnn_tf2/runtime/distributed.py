"""The process world of a run: one process, or N Horovod ranks started by `horovodrun` / `mpirun`.

`init_world()` returns a `World`. Under a launcher it initialises Horovod (the low-level
`horovod.tensorflow` API) and every collective goes through it; otherwise it is a single process whose
collectives return their input. Horovod is imported only under a launcher, so training, evaluation and
tests that do not need it run where it is not installed.

Keras 3 variables are not `tf.Variable`s: Horovod is handed the underlying `v.value`.
`horovod.tensorflow.keras.DistributedOptimizer` is deliberately not used: under Keras 3 it silently
skips the allreduce.
"""

import os

import keras
import tensorflow as tf

# Variables that a launcher sets in each process it starts: horovodrun (Gloo, and MPI through mpirun),
# Open MPI's mpirun, MPICH / Intel MPI (PMI).
LAUNCHER_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
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


def launched():
    """True when a launcher started this process as one rank of a job (see LAUNCHER_RANK_VARIABLES)."""
    return any(name in os.environ for name in LAUNCHER_RANK_VARIABLES)


def init_world():
    """The World of this process: Horovod's when launched by horovodrun/mpirun, else SINGLE_PROCESS.

    Raises RuntimeError when a launcher started the process but Horovod cannot be imported.
    """
    if not launched():
        return SINGLE_PROCESS
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", DEFAULT_GLOO_TIMEOUT_SECONDS)
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        variable = next(name for name in LAUNCHER_RANK_VARIABLES if name in os.environ)
        raise RuntimeError(
            f"started by a launcher ({variable} is set) but horovod.tensorflow does not import ({err}): "
            "run scripts/setup.sh, which builds Horovod into .venv") from err
    hvd.init()
    # One GPU per rank: each process must see only its own, before TensorFlow first touches them.
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
    return World(hvd.size(), hvd.rank(), hvd.local_rank(), hvd)
