"""The engine thread of a server (serve.worker) over stories260K: a job of n choices under one
JSON schema compiles it once, and off the engine thread when the handler awaits
`Worker.submit`; a call or job whose caller gave up before the engine thread came to it is
skipped (nothing submitted) and the thread serves on; a job whose caller gave up while it
was being submitted has its requests cancelled."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from support.models import STORIES_HF, model_path
from support.schemas import PERSON

import jaxinfer
from jaxinfer.options import SamplingParams
from jaxinfer.runtime.request import Result
from jaxinfer.serve.worker import Task, Worker

OPTS = dict(slots=4, max_seq_len=512, prefill_buckets=(32, 128), batch_buckets=(1, 4))
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # the whole distribution
WAIT = 60  # seconds: a dead engine thread fails a test instead of hanging it


@pytest.fixture(scope="module")
def worker():
    w = Worker(lambda: jaxinfer.load(model_path(STORIES_HF), **OPTS))
    w.start()
    assert w.wait_ready(600), w.error
    yield w
    w.stop()


def person_job(worker: Worker, n: int) -> list[tuple[list[int], SamplingParams]]:
    """n choices of one prompt under PERSON, seeds apart (as the server makes them)."""
    assert worker.engine is not None
    ids = worker.engine.tokenize("Tell me about a person.")
    params = SamplingParams(max_new_tokens=120, json_schema=PERSON, **SAMPLED)
    return [(ids, params.replace(seed=i)) for i in range(n)]


async def results(task: Task, n: int) -> list[Result]:
    """Every request's Result, from the task's inbox (pieces skipped)."""
    out: dict[int, Result] = {}
    while len(out) < n:
        index, item = await asyncio.wait_for(task.inbox.get(), WAIT)
        assert not isinstance(item, Exception), item
        if isinstance(item, Result):
            out[index] = item
    return [out[i] for i in range(n)]


def check_people(done: list[Result]) -> None:
    for r in done:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)


def test_a_job_of_16_choices_compiles_its_schema_once(worker, compiled):
    """Opened as a handler did before Worker.submit existed: still one compile, not 16."""

    async def job():
        task = Task(person_job(worker, 16), stream=False)
        handles = await asyncio.wait_for(asyncio.wrap_future(worker.open(task)), WAIT)
        return await results(task, len(handles))

    done = asyncio.run(job())
    assert compiled == ["jaxinfer-engine"]
    assert len(done) == 16
    check_people(done)


def test_submit_compiles_the_schema_off_the_engine_thread(worker, compiled):
    """Worker.submit compiles on the handlers' pool; the engine thread only copies."""

    async def job(pool):
        task = Task(person_job(worker, 16), stream=True)
        handles = await asyncio.wait_for(worker.submit(task, pool), WAIT)
        return await results(task, len(handles))

    with ThreadPoolExecutor(1, thread_name_prefix="handler") as pool:
        done = asyncio.run(job(pool))
    assert compiled == ["handler_0"]
    check_people(done)


async def engine_call(worker: Worker, fn):
    return await asyncio.wait_for(asyncio.wrap_future(worker.call(fn)), WAIT)


def stall(worker: Worker):
    """Hold the engine thread in a call until the returned event is set."""
    gate = threading.Event()
    stalled = worker.call(lambda engine: gate.wait(WAIT))
    return gate, stalled


def test_a_call_cancelled_before_it_runs_is_skipped_and_the_worker_serves_on(worker):
    gate, stalled = stall(worker)
    ran: list = []
    doomed = worker.call(lambda engine: ran.append(engine))
    assert doomed.cancel()
    gate.set()
    assert stalled.result(WAIT) is True
    assert worker.call(lambda engine: "served").result(WAIT) == "served"
    assert ran == []


def test_a_job_whose_client_left_before_it_began_submits_nothing(worker):
    """The handler's asyncio wait on open() is cancelled (its client left) while the engine
    thread is busy: the job is skipped, and the next job is served."""

    async def main():
        gate, stalled = stall(worker)
        task = Task(person_job(worker, 2), stream=True)
        waiting = asyncio.ensure_future(asyncio.wrap_future(worker.open(task)))
        await asyncio.sleep(0.1)  # the handler awaits the engine thread
        waiting.cancel()
        await asyncio.sleep(0.1)  # asyncio passes the cancel on to the concurrent Future
        gate.set()
        assert await asyncio.wait_for(asyncio.wrap_future(stalled), WAIT) is True
        activity = await engine_call(worker, lambda engine: engine.activity())
        task = Task(person_job(worker, 1), stream=False)
        handles = await asyncio.wait_for(asyncio.wrap_future(worker.open(task)), WAIT)
        return waiting, activity, await results(task, len(handles))

    waiting, activity, done = asyncio.run(main())
    assert waiting.cancelled()
    assert activity == {"running": 0, "queued": 0}  # nothing of the cancelled job runs
    check_people(done)


def test_a_job_whose_client_left_while_it_was_submitted_is_cancelled(worker):
    """Worker.submit cancelled after the engine thread began the task (too late to skip it):
    the requests it made are cancelled at once, freeing their slots."""
    began, gate = threading.Event(), threading.Event()

    class SlowTask(Task):
        def submit(self, engine):  # what the engine thread runs of a task without echo
            began.set()
            gate.wait(WAIT)
            return super().submit(engine)

    async def main():
        task = SlowTask(person_job(worker, 4), stream=True)
        waiting = asyncio.ensure_future(worker.submit(task))
        assert await asyncio.to_thread(began.wait, WAIT)
        waiting.cancel()
        await asyncio.sleep(0.1)
        gate.set()
        done = await results(task, 4)  # each one's (cancelled) Result
        activity = await engine_call(worker, lambda engine: engine.activity())
        return waiting, done, activity

    waiting, done, activity = asyncio.run(main())
    assert waiting.cancelled()
    assert [r.finish_reason for r in done] == ["cancelled"] * 4
    assert activity == {"running": 0, "queued": 0}
