"""StableDRL-JAX: stable RL post-training for diffusion language models."""

import setuptools

setuptools.setup(
    name="stabledrl_jax",
    version="0.1.0",
    description="StableDRL in JAX/Flax: stable reinforcement learning for masked diffusion language models.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # configs/ (the get_config() files) is installed as the package stabledrl_jax.configs, so that
    # `--config quickstart` works from any install (training/config_lib.config_path).
    packages=(setuptools.find_packages(include=["stabledrl_jax", "stabledrl_jax.*"])
              + ["stabledrl_jax.configs"]),
    package_dir={"stabledrl_jax.configs": "configs"},
    # The d1 test sets of countdown and sudoku (tasks.packaged_files()).
    package_data={"stabledrl_jax.tasks": ["data/*"]},
    python_requires=">=3.11",  # jax >= 0.7 needs it.
    entry_points={
        "console_scripts": [
            "stabledrl-train = stabledrl_jax.train:run",
            "stabledrl-evaluate = stabledrl_jax.evaluate:run_cli",
            "stabledrl-score = stabledrl_jax.scoring:main",
            "stabledrl-export = stabledrl_jax.export:run",
            "stabledrl-plan = stabledrl_jax.plan:run",
        ],
    },
    install_requires=[
        "jax>=0.7",
        "flax>=0.12",
        "optax>=0.2.5",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.90",
        "ml_collections>=1.0",
        "absl-py>=2.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "math-verify>=0.7",
        "etils[epath]>=1.7",  # workdir paths, local or gs:// (training/state/checkpointing.py)
        # Checkpoints and tokenizers by Hub id (models/hub.py): cached, honours HF_HUB_OFFLINE.
        "huggingface_hub>=0.24",
        # A LoRA run's frozen base stored in int8 or 4-bit (models/layers.QuantizedKernel): qwix's
        # quantize / dot_general, which compile for TPU, GPU and CPU. Pinned: its QArray layout.
        "qwix==0.1.8",
    ],
    extras_require={
        # Parquet datasets (tasks.read_records); the Hugging Face Hub loader also needs `datasets`.
        "data": ["pyarrow>=14"],
        # Hub datasets (data.train='hub').
        "datasets": ["datasets>=2.18", "pyarrow>=14"],
        # experiments/ plots (the quickstart run, the stress test, the comparison).
        "plot": ["matplotlib>=3.7"],
        # The jax build for the accelerator (the core dependency is the CPU build).
        "tpu": ["jax[tpu]>=0.7"],
        "cuda": ["jax[cuda12]>=0.7"],
        # gs:// workdirs: epath's and TensorBoard's Cloud Storage backends.
        "gcs": ["gcsfs>=2024.2", "google-cloud-storage>=2.14"],
        # tests/test_peft.py checks our LoRA adapters against peft itself, on the CPU (CI installs
        # torch 2.13.0's CPU build, constraints.txt; without this extra those tests skip).
        "peft": ["torch>=2.1", "peft>=0.15"],
        "test": [
            "pytest>=8",
            "wheel>=0.42",  # tests/test_packaging.py builds the wheel of a non-editable install
            "matplotlib>=3.7",  # the experiments' plots are tested
            "pytest-xdist>=3.5",
            "filelock>=3.12",  # tests/conftest.py: one supervised start shared by the workers
            "hypothesis>=6.100",
            "pyarrow>=14",  # so that the Parquet loader is tested, not skipped
            "datasets>=2.18",  # Hub datasets, tested on local copies in the Hub layout
            "nbmake>=1.5",  # executes notebooks/*.ipynb as tests
            "ipykernel>=6",  # the notebooks' kernel
            # libtpu: tests/test_tpu_compile.py compiles for TPU topologies on a CPU host.
            "jax[tpu]>=0.7",
        ],
    },
)
