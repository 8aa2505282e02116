"""The site daemon: `daemon.SiteDaemon` dials the server, trains the rounds it is given
on the site's data (`data`), in this process or on a DDP worker group (`workers`),
and runs its side of secure aggregation (`secagg`).

Nothing here imports the aggregation server (`fedtrain.runtime.server`); what both
ends share lives in `fedtrain.runtime`.
"""
