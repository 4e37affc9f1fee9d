"""The chat page (issue 47 item 6, `metatp.server.chat_page`): served at / and /chat without a key,
off with --no-webui, and driven in a real headless Chromium against a real `metatp serve` with an
API key: a message typed and sent streams its answer in (more than one piece), the system prompt,
the conversation and the settings reach the request (max_tokens=3: three tokens, finish "length"),
Stop aborts the stream, Clear empties the conversation, text is inserted as text, without the key
the server's 401 shows in the page, and the page's SSE reader survives any split of the stream.
Screenshots are kept as test artifacts in $METATP_TEST_ARTIFACTS (default test-artifacts/ in the
checkout): chat_page.png (the synthetic model: byte soup) and, with the default model (slow),
chat_page_model.png."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=46, chat_template=TEMPLATE,
                 n_ctx_train=4096)
KEY = "sk-chat-page"
WAIT_S = 60

# Installed into the page before a test sends: every chat request's body is kept (window.sentBodies)
# and, where the test asks (window.extraBody), fields are added to it; every text the newest
# assistant message showed is kept (window.seenTexts), to see the answer grow piece by piece; with
# window.stopOnFirstPiece set, the Stop button is clicked as soon as the answer shows its first piece
# (a tiny synthetic model streams faster than a click from outside the page could land); with
# window.unreachable set, fetch fails as it does when the server is down.
RECORD = """
window.sentBodies = []; window.seenTexts = []; window.extraBody = arguments[0];
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (window.unreachable) return Promise.reject(new TypeError('Failed to fetch'));
  if (String(url).endsWith('/chat/completions')) {
    const body = Object.assign(JSON.parse(options.body), window.extraBody);
    window.sentBodies.push(body);
    options = Object.assign({}, options, {body: JSON.stringify(body)});
  }
  return realFetch(url, options);
};
new MutationObserver(() => {
  const answers = document.querySelectorAll('.message.assistant .content');
  const text = answers.length ? answers[answers.length - 1].textContent : '';
  if (window.seenTexts[window.seenTexts.length - 1] !== text) window.seenTexts.push(text);
  if (text && window.stopOnFirstPiece) document.getElementById('stop').click();
}).observe(document.getElementById('conversation'), {childList: true, subtree: true, characterData: true});
"""


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("METATP_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ---------------------------------------------------------------- the routes, in-process
def _app_client(path: str, **options):
    from metatp import LLM
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    return testclient.TestClient(create_app(LLM(path, backend="numpy", n_ctx=128), api_key=KEY, **options))


@requires("serve")
def test_the_page_is_served_without_a_key_and_the_api_still_needs_one(path):
    with _app_client(path) as client:
        for route in ("/", "/chat"):
            r = client.get(route)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text
            assert "default-src 'none'" in r.headers["content-security-policy"]
            assert '<script src="/static/chat.js"' in r.text and "<script>" not in r.text      # no inline script
        js = client.get("/static/chat.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in js.text                    # model text goes in as text, never as HTML
        assert client.get("/static/chat.css").headers["content-type"].startswith("text/css")
        assert client.get("/v1/models").status_code == 401
        assert client.get("/static/nothing.js").status_code == 404


@requires("serve")
def test_no_webui_turns_the_page_off(path, monkeypatch):
    import metatp.server
    from metatp.cli import main

    served: list[dict] = []             # `metatp serve`'s call of serve(), which would listen
    monkeypatch.setattr(metatp.server, "serve", lambda llm, **options: served.append(options))
    for flags, webui in (([], True), (["--no-webui"], False)):
        assert main(["serve", "-m", path, "-c", "64", "--backend", "numpy", "--no-warmup", *flags]) == 0
        assert served[-1]["webui"] is webui
    with _app_client(path, webui=False) as client:
        for route in ("/", "/chat", "/static/chat.js"):
            r = client.get(route)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


# ---------------------------------------------------------------- in the browser
@pytest.fixture(scope="module")
def chat_page_server(path, tmp_path_factory):
    s = MetatpServe(path, "-c", "4096", "--parallel", "2", "--api-key", KEY,
                    log=tmp_path_factory.mktemp("chat-page") / "serve.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def chat_page_browser():
    """Headless Chromium (the system's), driven through its chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,760"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


class Page:
    """The chat page in the browser, opened fresh (nothing kept from an earlier test)."""

    def __init__(self, driver, base: str, key: str | None, extra_body: dict | None = None) -> None:
        self.d = driver
        driver.get(base + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(base + "/")
        # chat.js has run once the conversation says it is not busy
        self.wait_for(lambda: self.js("return document.getElementById('conversation').getAttribute('aria-busy')") == "false")
        driver.execute_script(RECORD, extra_body or {})
        if key is not None:
            self.fill("api-key", key)

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def el(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.ID, element_id)

    def fill(self, element_id: str, text: str) -> None:
        field = self.el(element_id)
        field.clear()
        field.send_keys(text)

    def wait_for(self, condition, timeout: float = WAIT_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.02)
        pytest.fail(f"the page did not get there within {timeout} s; it shows:\n{self.el('conversation').text}\n"
                    f"error: {self.el('error').text!r} status: {self.el('status').text!r}")

    def send(self, text: str) -> None:
        from selenium.webdriver.common.keys import Keys

        self.el("message").send_keys(text, Keys.ENTER)          # Enter sends

    def answers(self) -> list[dict]:
        return self.js("""return [...document.querySelectorAll('.message.assistant')].map(m => ({
            text: m.querySelector('.content').textContent, chunks: Number(m.dataset.chunks),
            finish: m.dataset.finish || null}))""")

    def finished_answers(self, n: int) -> list[dict]:
        """The answers once the n-th has finished (the Send button is back)."""
        self.wait_for(lambda: len(self.answers()) >= n and self.answers()[n - 1]["finish"] is not None
                      and self.el("send").is_enabled())
        return self.answers()

    def error(self) -> str:
        return self.el("error").text if self.el("error").is_displayed() else ""


in_browser = requires("serve", "browser")      # a real server and headless Chromium


@in_browser
def test_a_message_streams_in_with_the_system_prompt_settings_and_conversation_in_the_request(
        chat_page_server, chat_page_browser):
    page = Page(chat_page_browser, chat_page_server.base, KEY, {"ignore_eos": True})
    page.fill("system-prompt", "You answer in haiku.")
    page.fill("temperature", "0")
    page.fill("max-tokens", "48")
    page.fill("seed", "7")
    page.send("Tell me about tensor parallelism.")
    (first,) = page.finished_answers(1)
    assert page.error() == "" and first["finish"] == "length" and first["text"], first
    assert first["chunks"] > 1, first                            # the answer came as a stream of pieces
    seen = page.js("return window.seenTexts")
    grew = [t for t in seen if t]
    assert len(grew) > 1 and all(b.startswith(a) and len(b) > len(a) for a, b in zip(grew, grew[1:])), seen
    assert grew[-1] == first["text"]
    assert "48 tokens" in page.el("status").text and "finished: length" in page.el("status").text

    page.fill("max-tokens", "3")
    page.fill("stop-strings", "never-in-the-text\nnor this")
    page.send("And briefly?")
    answers = page.finished_answers(2)
    assert answers[1]["finish"] == "length" and 1 <= answers[1]["chunks"] <= 3, answers
    assert "3 tokens" in page.el("status").text
    sent = page.js("return window.sentBodies")
    assert len(sent) == 2
    assert sent[0]["messages"] == [{"role": "system", "content": "You answer in haiku."},
                                   {"role": "user", "content": "Tell me about tensor parallelism."}]
    assert (sent[0]["temperature"], sent[0]["max_tokens"], sent[0]["seed"], sent[0]["stream"]) == (0, 48, 7, True)
    assert sent[0]["top_p"] == 0.95 and "stop" not in sent[0]
    assert sent[1]["messages"][1:] == [{"role": "user", "content": "Tell me about tensor parallelism."},
                                       {"role": "assistant", "content": first["text"]},
                                       {"role": "user", "content": "And briefly?"}]
    assert sent[1]["max_tokens"] == 3 and sent[1]["stop"] == ["never-in-the-text", "nor this"]
    chat_page_browser.save_screenshot(str(artifacts_dir() / "chat_page.png"))


@in_browser
def test_without_the_key_the_401_shows_and_with_it_the_answer_comes(chat_page_server, chat_page_browser):
    page = Page(chat_page_browser, chat_page_server.base, None)
    assert page.wait_for(lambda: page.el("model").text) == "API key needed"
    page.fill("max-tokens", "4")
    page.send("hello")
    page.wait_for(page.error)
    assert page.error().startswith("401:") and "API key" in page.error()
    assert page.answers() == [] and page.el("message").get_attribute("value") == "hello"    # back in the box

    page.js("window.unreachable = true")
    page.el("send").click()
    page.wait_for(lambda: "cannot reach the server: Failed to fetch" in page.error() and page.el("send").is_enabled())
    page.js("window.unreachable = false")

    page.fill("api-key", "sk-wrong")
    page.el("send").click()
    page.wait_for(lambda: page.error() and page.el("send").is_enabled())
    assert page.error().startswith("401:")

    page.fill("api-key", KEY)
    page.el("send").click()
    (answer,) = page.finished_answers(1)
    assert page.error() == "" and answer["text"] and answer["finish"] in ("length", "stop"), answer
    assert page.js("return localStorage.getItem('metatp.chat.api-key')") == KEY     # kept for the next visit
    chat_page_browser.refresh()
    page.wait_for(lambda: page.el("model").text == "m")
    assert page.el("api-key").get_attribute("value") == KEY


@in_browser
def test_stop_aborts_the_stream_and_clear_empties_the_conversation(chat_page_server, chat_page_browser):
    page = Page(chat_page_browser, chat_page_server.base, KEY, {"ignore_eos": True})
    page.fill("max-tokens", "1800")
    page.js("window.stopOnFirstPiece = true")
    page.send("Write at length.")
    (answer,) = page.finished_answers(1)
    page.js("window.stopOnFirstPiece = false")
    assert answer["finish"] == "stopped" and page.el("status").text == "stopped" and page.error() == "", answer
    # the click lands before the page reads its next event (the observer runs first): one piece of 1800
    assert answer["text"] and answer["chunks"] == 1, answer
    assert page.el("send").is_enabled() and not page.el("stop").is_enabled()
    time.sleep(0.3)
    assert page.answers()[0]["text"] == answer["text"]          # nothing more arrives
    page.el("clear").click()
    assert page.answers() == [] and page.js("return document.querySelectorAll('.message').length") == 0
    page.fill("max-tokens", "2")
    page.send("again")                                         # the server is still serving; the history is gone
    page.finished_answers(1)
    sent = page.js("return window.sentBodies")
    assert sent[-1]["messages"] == [{"role": "user", "content": "again"}]


@in_browser
def test_text_is_shown_as_text_never_as_html(chat_page_server, chat_page_browser):
    page = Page(chat_page_browser, chat_page_server.base, KEY)
    page.fill("max-tokens", "2")
    hostile = "<b>bold</b> & <img src=x onerror=\"document.title='owned'\">"
    page.send(hostile)
    page.finished_answers(1)
    user = page.js("const c = document.querySelector('.message.user .content'); "
                   "return {text: c.textContent, children: c.children.length}")
    assert user == {"text": hostile, "children": 0}
    assert page.js("return document.querySelectorAll('.message img, .message b').length") == 0
    assert chat_page_browser.title == "metatp chat"


@in_browser
def test_server_events_are_parsed_across_any_split_of_the_stream(chat_page_server, chat_page_browser):
    """The page's SSE reader (serverEvents) on a stream cut at every byte: an event, a line ending
    (CRLF too) or a multi-byte character split between reads gives the same events, and [DONE] ends it."""
    page = Page(chat_page_browser, chat_page_server.base, None)
    stream = ('data: {"choices":[{"delta":{"content":"héllo — 😀"}}]}\n\n'        # raw UTF-8: 2, 3 and 4 bytes
              ': a comment\r\ndata: {"choices":[{"delta":{"content":"世界"}}]}\r\n\r\n'
              'data: {"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\ndata: {"after":"done"}\n\n')
    events = page.d.execute_async_script("""
        const [text, done] = arguments;
        const bytes = new TextEncoder().encode(text);
        (async () => {
          const results = [];
          for (const size of [1, 2, 3, 5, 7, bytes.length]) {       // bytes per read
            let at = 0;
            const body = new ReadableStream({pull(c) {
              if (at >= bytes.length) { c.close(); return; }
              c.enqueue(bytes.slice(at, at + size)); at += size; }});
            const got = [];
            for await (const e of serverEvents(body)) got.push(e);
            results.push(got);
          }
          done(results);
        })().catch((e) => done(String(e)));
    """, stream)
    want = [{"choices": [{"delta": {"content": "héllo — 😀"}}]}, {"choices": [{"delta": {"content": "世界"}}]},
            {"usage": {"completion_tokens": 2}}]
    assert events == [want] * 6, events


# ---------------------------------------------------------------- the default model, for a readable screenshot
@pytest.fixture(scope="module")
def chat_page_model_server(default_model, tmp_path_factory):
    s = MetatpServe(str(default_model), "-c", "1024", "--parallel", "1", log=tmp_path_factory.mktemp("chat-page-model")
                    / "serve.log", ready=180, alias="smollm2-135m")
    yield s
    s.stop()


@pytest.mark.slow
@in_browser
def test_the_default_model_answers_a_question_in_the_page(chat_page_model_server, chat_page_browser):
    page = Page(chat_page_browser, chat_page_model_server.base, None)
    assert page.wait_for(lambda: page.el("model").text) == "smollm2-135m"
    page.fill("system-prompt", "You are a helpful assistant. Answer in one short sentence.")
    page.fill("temperature", "0")
    page.fill("max-tokens", "40")
    page.send("What is the capital of France?")
    (answer,) = page.finished_answers(1)
    assert page.error() == "" and "Paris" in answer["text"] and answer["chunks"] > 1, answer
    grew = [t for t in page.js("return window.seenTexts") if t]
    assert len(grew) > 1 and grew[-1] == answer["text"]
    chat_page_browser.save_screenshot(str(artifacts_dir() / "chat_page_model.png"))
