"""What every StageDiff server shares: bootstrap, wire codec, checkpoints, process groups.

Importing it drops the libraries' import-time warnings that say nothing about this deployment from the logs
(services/library_noise.py): every server process imports it before a stage loads torchao.
"""

from services.library_noise import drop_library_noise

drop_library_noise()
