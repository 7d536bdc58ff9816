"""Device memory: tagged pools backed by CUDA virtual memory, and sleep mode.

sleep_backend.py  the SleepModeBackend ABC, the registry (built-ins, register_backend,
                  the "spindle.sleep_backends" entry point group) and the tags
cumem.py          CuMemAllocator (weights / kv_cache pools on cuMemCreate / cuMemMap)
                  and the "cumem" backend, which keeps addresses and CUDA graphs
portable.py       the "portable" backend: moves tensors out and back, any device
device_lock.py    a file lock per physical device, serialising sleep / wake between
                  engines that share it
"""
