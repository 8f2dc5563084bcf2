"""The tools around the packing job, each reading through the stages (never through the Beam job):

* :mod:`~pipeline._tools.preview`: the first records of each input, read, rendered and masked (``packstream preview``);
* :mod:`~pipeline._tools.estimate`: a packing job predicted from a sample of its inputs (``packstream estimate``);
* :mod:`~pipeline._tools.verify`: a whole output folder re-checked from its files (``packstream verify``);
* :mod:`~pipeline._tools.inspect`: what a finished output holds, from its shards (``packstream inspect``).
"""
