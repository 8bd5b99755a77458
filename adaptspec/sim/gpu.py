"""Built-in GPU and CPU step-cost profiles: ``adaptspec.control.gpu_profiles``."""
from adaptspec.control.gpu_profiles import *  # noqa: F401,F403
from adaptspec.control.gpu_profiles import BUILTIN, builtin_profile, cpu_profile, gpu_profile  # noqa: F401
