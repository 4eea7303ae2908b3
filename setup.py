"""hvdtrain: data-parallel Keras training on Horovod's ring-allreduce.

TensorFlow is an extra (`cpu` or `gpu`) because the two wheels provide the same module and must not
both be installed; scripts/setup.sh picks its version by stack (keras3: 2.18.1, keras2: 2.15.1).
Horovod must be built *after* TensorFlow (scripts/setup.sh does it in order). The build itself is
declared in pyproject.toml.
"""
from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Data-parallel training of Keras models with Horovod ring-allreduce",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    python_requires=">=3.9,<3.14",
    install_requires=[
        "numpy",
        "mpi4py>=3.1,<5",
        "pyyaml>=5.4",
        "scikit-learn>=1.2,<1.6",
        "horovod==0.28.1",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.15.1,<2.22"],
        "gpu": ["tensorflow[and-cuda]>=2.15.1,<2.22"],
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6",
                # Kubernetes' own JSON schemas, offline: docker/k8s/mpijob.yaml is validated against them
                "kubernetes-validate>=1.28"],
        # the bench's plots. Not in dev: Keras 3 imports matplotlib.pyplot at start-up wherever it is
        # installed, half a second of every worker's start
        "plots": ["matplotlib>=3.6"],
    },
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.__main__:main"]},
)
