"""Pure-TF tensor ops: the reference implementations of the detection-specific math."""
