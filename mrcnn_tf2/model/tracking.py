"""Checkpoint tracking of layers held in Python lists.

Keras 3.15 tracks layers kept in lists (a ResNet's blocks, a head's convs) for its own weight lists, but
does not expose them to TensorFlow's object-based checkpoints (keras-team/keras#18398): a
`tf.train.Checkpoint(model=...)` would silently save only the directly assigned layers. Every layer class
of the model that owns sublayers derives from `TracksSublayers`, which names each direct sublayer as a
checkpoint child. Sublayer names are set explicitly in this package, so checkpoint keys do not depend on
how many layers a process created before.
"""


class TracksSublayers:
    """Mixin for keras.layers.Layer / keras.Model subclasses: direct sublayers become checkpoint children."""

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        for layer in self._flatten_layers(include_self=False, recursive=False):
            children.setdefault(layer.name, layer)
        return children
