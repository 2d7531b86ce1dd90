"""Train / eval / infer / export loops and their support (schedule, checkpoints, logging)."""
