"""`stagediff up`: a docker-compose file run as local processes.

compose.py reads the file and shapes its services for the model and the replicas asked for; launch.py turns a
service into a command for this machine; supervisor.py starts, watches and stops the processes; up.py is the
command. Nothing here is imported by the client: the CLI loads this package only for `up`.
"""
