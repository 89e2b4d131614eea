"""The demo's runs, launched through the webserver's API: a Ctrl-C terminates the run in
flight and stops the demo; the webserver's instance is the demo's, queue aside."""

import os
import signal
import subprocess
import sys
import threading
import uuid

import dagster as dg
import pytest
import yaml

from zarrfeed.commands.launcher import Launcher, launcher_config


class Client:
    """The GraphQL client's two calls the launcher makes, on ``instance`` directly: a
    submitted run starts and never ends by itself (``ctrl_c``: a Ctrl-C comes while it
    runs); terminating it cancels it."""

    def __init__(
        self, instance: dg.DagsterInstance, ctrl_c: bool = False, succeed: bool = False
    ) -> None:
        self.instance = instance
        self.ctrl_c, self.succeed = ctrl_c, succeed  # succeed: a run ends as it is submitted
        self.terminated: list[str] = []

    def submit_job_execution(self, job: str, **options: object) -> str:
        run = dg.DagsterRun(job_name=job, run_id=str(uuid.uuid4()), tags=options.get("tags"))
        self.instance.add_run(run)
        self.instance.report_run_canceling(run)  # in progress, as a started run
        if self.succeed:
            self.instance.handle_run_event(
                run.run_id,
                dg.DagsterEvent(
                    event_type_value=dg.DagsterEventType.RUN_SUCCESS.value, job_name=job
                ),
            )
        if self.ctrl_c:  # one, once the first run is in flight
            self.ctrl_c = False
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        return run.run_id

    def terminate_run(self, run_id: str) -> None:
        self.terminated.append(run_id)
        self.instance.report_run_canceled(self.instance.get_run_by_id(run_id))


def test_a_ctrl_c_terminates_the_runs_in_flight_and_stops_the_demo():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with dg.instance_for_test() as instance:
            client = Client(instance, ctrl_c=True)
            with pytest.raises(KeyboardInterrupt):
                Launcher(client, instance).run("ct_build", tags={"dagster/partition": "k"})
            [run_id] = client.terminated
            run = instance.get_run_by_id(run_id)
            assert run.status == dg.DagsterRunStatus.CANCELED
            assert run.tags["dagster/partition"] == "k"

            client = Client(instance, ctrl_c=True)
            requests = [("ct_build", {"tags": {"dagster/partition": k}}) for k in "abc"]
            with pytest.raises(KeyboardInterrupt):
                list(Launcher(client, instance).runs(requests, at_once=2))
            stopped = [instance.get_run_by_id(r) for r in client.terminated]
            assert [r.tags["dagster/partition"] for r in stopped] == ["a", "b"]  # c: never
            assert all(r.status == dg.DagsterRunStatus.CANCELED for r in stopped)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_runs_in_flight_together_end_in_the_order_requested():
    with dg.instance_for_test() as instance:
        requests = [("ct_build", {"tags": {"dagster/partition": k}}) for k in "abc"]
        done = list(Launcher(Client(instance, succeed=True), instance).runs(requests, 2))
        assert [f.run.tags["dagster/partition"] for f in done] == ["a", "b", "c"]
        assert all(f.run.is_success and f.seconds >= 0 for f in done)


class FirstEndsLate(Client):
    """Runs end as they are submitted, but the first only after 2 s; ``first_ended`` says,
    for each later submission, whether the first had ended by then."""

    def __init__(self, instance: dg.DagsterInstance) -> None:
        super().__init__(instance)
        self.first: str | None = None
        self.first_ended: list[bool] = []

    def submit_job_execution(self, job: str, **options: object) -> str:
        self.succeed = self.first is not None
        run_id = super().submit_job_execution(job, **options)
        if self.first is None:
            self.first = run_id
            threading.Timer(2.0, self.end_first).start()
        else:
            self.first_ended.append(self.instance.get_run_by_id(self.first).is_finished)
        return run_id

    def end_first(self) -> None:
        self.instance.report_run_failed(self.instance.get_run_by_id(self.first))


def test_a_run_that_ends_frees_its_slot_while_an_earlier_one_still_runs():
    with dg.instance_for_test() as instance:
        client = FirstEndsLate(instance)
        requests = [("ct_build", {"tags": {"dagster/partition": k}}) for k in "abcd"]
        done = list(Launcher(client, instance).runs(requests, at_once=2))
        assert client.first_ended == [False, False, False]  # b, c, d: while a ran
        assert [f.run.tags["dagster/partition"] for f in done] == ["a", "b", "c", "d"]
        assert not done[0].run.is_success and all(f.run.is_success for f in done[1:])


def test_a_webserver_that_dies_while_a_run_is_in_progress_is_an_error():
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    with dg.instance_for_test() as instance:
        launcher = Launcher(Client(instance), instance, gone)
        with pytest.raises(RuntimeError, match="exited with status 3 while run"):
            launcher.run("ct_build")


def test_a_run_the_webserver_put_elsewhere_is_an_error():
    with (
        dg.instance_for_test() as instance,
        dg.instance_for_test() as elsewhere,
        pytest.raises(RuntimeError, match="instance other than"),
    ):
        Launcher(Client(elsewhere), instance).run("ct_build")


def test_the_webservers_instance_is_the_homes_with_runs_launched_at_once(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry: {enabled: false}\n"
        "run_coordinator: {module: dagster.core.run_coordinator, class: QueuedRunCoordinator}\n"
        "concurrency: {pools: {default_limit: 1}}\n"
    )
    config = launcher_config(home)
    assert config["telemetry"] == {"enabled": False} and config["concurrency"]
    assert config["run_coordinator"]["class"] == "DefaultRunCoordinator"
    folder = tmp_path / "launcher"
    folder.mkdir()
    (folder / "dagster.yaml").write_text(yaml.safe_dump(config))
    with dg.DagsterInstance.from_config(str(home)) as ours:
        ours.add_run(dg.DagsterRun(job_name="j", run_id=str(uuid.uuid4())))
    with dg.DagsterInstance.from_config(str(folder)) as theirs:
        assert [r.job_name for r in theirs.get_runs()] == ["j"]  # the same storage
        assert theirs.root_directory == str(home.resolve())

    postgres = {"postgres": {"postgres_url": "postgresql://db/dagster"}}
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": postgres}))
    assert launcher_config(home)["storage"] == postgres  # the home's own storage, kept
    (home / "dagster.yaml").write_text("- not a mapping\n")
    with pytest.raises(ValueError, match=r"dagster\.yaml: expected a mapping"):
        launcher_config(home)
