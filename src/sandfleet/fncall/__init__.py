"""The ``fncall`` kind: stateless calls run in pools of warm, scrubbed workers.

- :mod:`.worker`: the zygote, PID 1 of each worker box (standard library only);
- :mod:`.conn`: the node's connection to one worker;
- :mod:`.pool`: sizing, queueing and replacement of one pool's workers;
- :mod:`.service`: the node's pools and the calls handed to them;
- :mod:`.images`: the default fncall image.
"""
