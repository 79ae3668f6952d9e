"""Replica sets behind the Engine protocol (between the engine and the server).

`inprocess.ReplicaSet`: ModelEngines of one model on several devices (or slots) of this process.
`front.ProcessReplicaSet`: one worker process per replica (`worker.py`), the declared messages of `wire.py`
between them, started as `start.py` says.
`rayengine.RayEngine`: the replicas of a Ray Serve deployment (`rayreplica.EngineReplica`, `serve --ray`), the
same messages through the deployment's handle.
"""
