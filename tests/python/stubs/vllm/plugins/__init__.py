#: How many times vllm_omni.plugins.load_omni_general_plugins asked for vllm's own plugins.
loaded = 0


def load_general_plugins():
    global loaded
    loaded += 1
