"""Replica sets behind the Engine protocol (between the engine and the server).

`inprocess.ReplicaSet`: ModelEngines of one model on several devices (or slots) of this process.
`front.ProcessReplicaSet`: one worker process per replica (`worker.py`), the declared messages of `wire.py`
between them, started as `start.py` says; `remote.RemoteReplica` is the front's handle on one worker, `restarts.py`
starts a dead one again.
`rayengine.RayEngine`: the replicas of a Ray Serve deployment (`rayreplica.EngineReplica`, `serve --ray`), the
same messages through the deployment's handle.
Both remote fronts replay their replicas' telemetry and settle futures through `relay.py`.
"""
