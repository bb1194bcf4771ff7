"""Code generation: the graph and a partition rendered as a standalone pipeline package."""

from .package import check_output_dir, edited_files, package_files, with_manifest, write_package
from .plan import StagePlan, plan_stages

__all__ = [
    "package_files",
    "with_manifest",
    "edited_files",
    "write_package",
    "check_output_dir",
    "plan_stages",
    "StagePlan",
]
