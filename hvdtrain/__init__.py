"""hvdtrain: data-parallel Keras training on Horovod's ring-allreduce."""
__version__ = "0.1.0"
