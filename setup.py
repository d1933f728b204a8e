from setuptools import find_packages, setup

setup(
    name="fairseq_bpd",
    version="0.1.0",
    description="Blockwise Parallel Decoding (Stern et al., 2018) as a fairseq plugin",
    packages=find_packages(include=["fairseq_bpd", "fairseq_bpd.*"]),
    package_data={"fairseq_bpd": ["csrc/*.cpp", "csrc/*.h"]},  # compiled on first use (fairseq_bpd/kernels.py)
    python_requires=">=3.11",
    # fairseq-fixed and torch are installed by scripts/setup.sh in a fixed order.
    install_requires=[],
)
