from setuptools import find_packages, setup

PADDLEFORMERS_TRIMMED = [  # enough of PaddleFormers to build its models on CPU (see README)
    "transformers==5.3.0", "huggingface_hub==1.33.0", "colorlog", "requests",
    "aistudio-sdk==0.3.9", "ml_dtypes", "omegaconf",
]

setup(
    name="paddle_cp",
    version="0.1.0",
    description="Context-parallel training for PaddlePaddle behind Paddle's parallelize API",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["paddle_cp", "paddle_cp.*"]),
    python_requires=">=3.9",
    # Paddle comes from an extra: `cpu` and `gpu` are alternative builds of the same `paddle`.
    install_requires=["numpy", "pyyaml"],
    extras_require={
        "cpu": ["paddlepaddle>=3.0"],
        "gpu": ["paddlepaddle-gpu>=3.0"],
        # paddleformers itself is installed with --no-deps (its full dependency set is ~2 GB).
        "test": ["pytest", *PADDLEFORMERS_TRIMMED],
    },
)
