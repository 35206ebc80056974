from setuptools import setup

setup(
    name="megalite",
    version="0.1.0",
    description="A compact Megatron-style 3D-parallel GPT pretraining framework",
    python_requires=">=3.10",
    packages=[
        "megalite",
        "megalite.config",
        "megalite.shape",
        "megalite.parallel",
        "megalite.pipeline",
        "megalite.model",
        "megalite.optim",
        "megalite.data",
        "megalite.checkpoint",
        "megalite.plan",
        "megalite.training",
        "megalite.cli",
        "megalite.kernels",
    ],
    # kernels/ is shipped as megalite.kernels: a top-level `kernels` package already exists on PyPI.
    package_dir={"megalite.kernels": "kernels"},
    # The scripts (pretrain_gpt.py, tools/*.py) are thin wrappers of these commands.
    entry_points={
        "console_scripts": [
            "megalite-train = megalite.train:cli",
            "megalite-run = megalite.cli.run:cli",
            "megalite-preprocess = megalite.cli.preprocess:cli",
            "megalite-merge-datasets = megalite.cli.merge_datasets:cli",
            "megalite-convert = megalite.cli.convert:cli",
            "megalite-generate = megalite.cli.generate:cli",
            "megalite-plan = megalite.cli.plan:cli",
            "megalite-serve = megalite.cli.serve:cli",
            "megalite-diagnose-hang = megalite.training.hang:cli",
        ]
    },
    install_requires=[
        # The releases tested (README "Supported versions"): torch 2.13 (make test) and 2.14.1
        # with its triton 3.8 (make test-compat); the APIs called: tests/unit/test_torch_version.py.
        "torch>=2.13",
        # 3.8 and 3.9 tested; torch 2.13's CUDA build pins 3.7.1, which no test runs.
        "triton>=3.8; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "sentencepiece",
        "safetensors",
        "wandb",
        "numpy",
        "pyyaml",
        "tqdm",
    ],
    # Optional, imported only when used (a clear error names the package when it is missing):
    # Hugging Face tokenizers, Parquet and .zst inputs; TensorBoard event files.
    extras_require={
        "hf": ["tokenizers", "pyarrow", "regex", "zstandard"],
        "tensorboard": ["tensorboard"],
        "test": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "transformers",
            "megatron-core==0.16.1",  # the oracle for Megatron data, samples and checkpoints
            "torchao==0.18.0",  # the oracle for FP8 tensorwise/rowwise (Float8Linear, emulate=True)
            "matplotlib",
            "tokenizers",
            "pyarrow",
            "regex",
            "zstandard",
            "tensorboard",
            "openai",  # the OpenAI client against megalite serve (tests/e2e/test_openai_api.py)
            "lm-eval[api,hf]",  # local-completions against the server, beside its hf backend
        ],
        "lint": ["ruff"],
    },
)
