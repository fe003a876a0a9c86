// The chat page: renders the conversation, streams answers over the websocket, Stop.
// A lost connection does not lose the answer: the page reconnects by itself (backoff with
// jitter), says it is reconnecting, and resumes the answer in place from the last token it has
// (each token frame carries its "seq"); a reloaded page resumes an answer still being written.
// Model output is Markdown: marked turns it into HTML, raw HTML in it shown as text (a literal
// "<svg>" or "<template>" is text, hiding nothing after it), and DOMPurify keeps only inert
// Markdown before it enters the page: no script, and nothing that loads a resource by itself
// (an image becomes a link to it), styles the page (no style attribute or element, no class) or
// sends anything (no form or form control). The page's Content-Security-Policy blocks the same.
(function () {
  "use strict";

  const state = JSON.parse(document.getElementById("chat-state").textContent);
  const list = document.getElementById("messages");
  const form = document.getElementById("composer");
  const prompt = document.getElementById("prompt");
  const sendButton = document.getElementById("send");
  const stopButton = document.getElementById("stop");
  const connection = document.getElementById("connection");
  const conversations = document.getElementById("conversation-list");

  const STATUS_LABELS = { stopped: "Stopped", error: "Error" };
  // Reconnection: the n-th attempt waits a random time between half and all of
  // min(RECONNECT_BASE_MS * 2^n, RECONNECT_MAX_MS), so pages that lost the same server do not
  // all come back at once.
  const RECONNECT_BASE_MS = 500;
  const RECONNECT_MAX_MS = 10000;
  let socket = null;
  let reconnectAttempt = 0;
  let current = null; // {id, text, seq, node} of the answer being written (seq: the last one)
  let pending = false; // a turn was sent and has not started or failed yet
  let resuming = false; // a resume was sent and not yet answered
  let renderQueued = false;
  let closingReason = null; // the server said why it closes the socket (an error frame)

  // What rendered Markdown may contain (everything else is dropped, its text kept).
  const SANITIZE = {
    ALLOWED_TAGS: ["a", "abbr", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3",
                   "h4", "h5", "h6", "hr", "i", "kbd", "li", "ol", "p", "pre", "s", "span",
                   "strong", "sub", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr",
                   "ul"],
    ALLOWED_ATTR: ["href", "title", "align", "start"],
    ALLOW_DATA_ATTR: false,
    ALLOW_ARIA_ATTR: false,
  };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }

  marked.setOptions({ gfm: true, breaks: true });
  marked.use({
    // Raw HTML in an answer is text: with no "html" (block) or "tag" (inline) token, marked
    // reads "<svg>", "<!--", "<script>", ... as the characters they are, escapes them, and the
    // Markdown around them still renders (an HTML block would swallow it up to a blank line).
    // So an unclosed element can hide nothing after it; DOMPurify stays as a second guard.
    tokenizer: {
      html: function () { return undefined; },
      tag: function () { return undefined; },
    },
    renderer: {
      // Should an HTML token still come (an extension's), it is shown as its text.
      html: function (token) {
        return escapeHtml(token.text);
      },
      // An image is shown as a link to it: nothing is fetched unless the user follows it.
      image: function (token) {
        const label = "image: " + (token.text || token.href || "");
        return '<a href="' + escapeHtml(token.href || "") + '">' + escapeHtml(label) + "</a>";
      },
      // Task lists without form controls.
      checkbox: function (token) {
        return token.checked ? "\u2611 " : "\u2610 ";
      },
    },
  });
  // Links open in a new tab, without telling the other site where they came from.
  DOMPurify.addHook("afterSanitizeAttributes", function (node) {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer nofollow");
    }
  });

  function renderMarkdown(text) {
    return DOMPurify.sanitize(marked.parse(text || ""), SANITIZE);
  }

  function scrollToEnd() {
    list.scrollTop = list.scrollHeight;
  }

  function messageNode(message) {
    const node = document.createElement("article");
    node.className = "message " + message.role;
    if (message.id) node.dataset.id = message.id;
    const body = document.createElement("div");
    body.className = "body";
    node.appendChild(body);
    const meta = document.createElement("div");
    meta.className = "meta";
    node.appendChild(meta);
    list.appendChild(node);
    fillMessage(node, message);
    return node;
  }

  function fillMessage(node, message) {
    const body = node.querySelector(".body");
    const meta = node.querySelector(".meta");
    node.dataset.status = message.status || "complete";
    if (message.role === "user") {
      body.textContent = message.content;
    } else {
      body.innerHTML = renderMarkdown(message.content);
    }
    meta.textContent = "";
    const label = STATUS_LABELS[message.status];
    if (label) {
      const badge = document.createElement("span");
      badge.className = "badge " + message.status;
      badge.textContent = label;
      meta.appendChild(badge);
    }
    if (message.finish_reason === "length" && message.status === "complete") {
      meta.appendChild(document.createTextNode("Cut at the length limit."));
    }
    if (message.error) {
      const error = document.createElement("p");
      error.className = "error-text";
      error.textContent = message.error;
      meta.appendChild(error);
    }
  }

  function setBusy(busy) {
    sendButton.disabled = busy;
    stopButton.hidden = !busy;
  }

  function showConnection(text, ok, reconnecting) {
    connection.textContent = text;
    connection.classList.toggle("ok", !!ok);
    connection.classList.toggle("reconnecting", !!reconnecting);
  }

  // The answer being written waits for the connection to come back (or stops waiting).
  function showReconnecting(on) {
    if (!current) return;
    current.node.classList.toggle("reconnecting", on);
    const meta = current.node.querySelector(".meta");
    if (on) {
      meta.textContent = "";
      const badge = document.createElement("span");
      badge.className = "badge reconnecting";
      badge.textContent = "Reconnecting…";
      meta.appendChild(badge);
    } else if (current.node.classList.contains("waiting") ||
               current.node.dataset.status === "streaming") {
      meta.textContent = "";
    }
  }

  function nodeOf(id) {
    return list.querySelector('article.message.assistant[data-id="' + Number(id) + '"]');
  }

  function follow(id, node) {
    current = { id: id, text: "", seq: -1, node: node };
    node.dataset.status = "streaming";
    node.classList.add("waiting");
    setBusy(true);
  }

  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(function () {
      renderQueued = false;
      if (!current) return;
      current.node.querySelector(".body").innerHTML = renderMarkdown(current.text);
      scrollToEnd();
    });
  }

  function addConversation(id, title) {
    state.conversation_id = id;
    const url = state.conversation_url.replace("/0/", "/" + id + "/");
    history.replaceState(null, "", url);
    document.title = title + " · Chat";
    const heading = document.querySelector(".chat-header h1");
    if (heading) heading.textContent = title;
    const item = document.createElement("li");
    item.className = "current";
    const link = document.createElement("a");
    link.href = url;
    link.dataset.id = id;
    link.textContent = title;
    item.appendChild(link);
    conversations.querySelectorAll("li.current").forEach(function (li) {
      li.classList.remove("current");
    });
    conversations.prepend(item);
  }

  function showError(text) {
    messageNode({ role: "assistant", content: "", status: "error", error: text });
    scrollToEnd();
  }

  function onFrame(frame) {
    switch (frame.type) {
      case "conversation":
        if (frame.created) addConversation(frame.id, frame.title);
        break;
      case "user_message":
        break; // already shown when sent
      case "start":
        pending = false;
        follow(frame.message_id, messageNode({ id: frame.message_id, role: "assistant",
                                               content: "", status: "streaming" }));
        scrollToEnd();
        break;
      case "resume":
        // The answer goes on here: the tokens after frame.after_seq follow (-1: all of them).
        resuming = false;
        pending = false;
        if (!current || current.id !== frame.message_id) {
          const node = nodeOf(frame.message_id) ||
            messageNode({ id: frame.message_id, role: "assistant", content: "",
                          status: "streaming" });
          follow(frame.message_id, node);
        }
        if (frame.after_seq !== current.seq) {
          current.text = "";
          current.seq = -1;
          scheduleRender();
        }
        showReconnecting(false);
        break;
      case "answer":
        // The answer ended while the page was away: shown as stored.
        resuming = false;
        pending = false;
        if (frame.message) {
          const node = (current && current.id === frame.message.id) ? current.node
            : (nodeOf(frame.message.id) || messageNode(frame.message));
          node.classList.remove("waiting", "reconnecting");
          fillMessage(node, frame.message);
        }
        current = null;
        setBusy(false);
        scrollToEnd();
        break;
      case "token":
        if (current && frame.message_id === current.id) {
          if (typeof frame.seq === "number") {
            if (frame.seq <= current.seq) break; // already shown
            current.seq = frame.seq;
          }
          current.node.classList.remove("waiting");
          current.text += frame.text;
          scheduleRender();
        }
        break;
      case "done":
        if (current && frame.message_id === current.id) {
          current.node.classList.remove("waiting", "reconnecting");
          fillMessage(current.node, { role: "assistant", content: current.text,
                                      status: frame.status, finish_reason: frame.finish_reason,
                                      error: frame.error });
          current = null;
        }
        setBusy(false);
        scrollToEnd();
        break;
      case "error":
        pending = false;
        if (frame.closing) closingReason = frame.message;
        if (resuming && current) {
          // The answer could not be taken up again: keep what the page has.
          current.node.classList.remove("waiting", "reconnecting");
          fillMessage(current.node, { role: "assistant", content: current.text,
                                      status: "error", error: frame.message });
          current = null;
        } else {
          showError(frame.message);
        }
        resuming = false;
        if (!current) setBusy(false);
        break;
    }
  }

  // After (re)connecting: take up the answer the page was showing or waiting for.
  function resume() {
    if (current && state.conversation_id) {
      resuming = true;
      socket.send(JSON.stringify({ type: "resume", conversation_id: state.conversation_id,
                                   message_id: current.id, after_seq: current.seq }));
    } else if (pending && state.conversation_id) {
      resuming = true;
      socket.send(JSON.stringify({ type: "resume", conversation_id: state.conversation_id,
                                   message_id: null, after_seq: null }));
    } else if (pending) {
      // A new conversation whose first frame never came: nothing to take up.
      showError("The connection was lost before the answer started. Send it again.");
      pending = false;
      setBusy(false);
    }
  }

  function reconnectLater() {
    const ceiling = Math.min(RECONNECT_BASE_MS * Math.pow(2, reconnectAttempt),
                             RECONNECT_MAX_MS);
    const delay = ceiling / 2 + Math.random() * ceiling / 2;
    reconnectAttempt += 1;
    showConnection("reconnecting…", false, true);
    showReconnecting(true);
    setTimeout(connect, delay);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + "/ws/chat/");
    if (!reconnectAttempt) showConnection("connecting…", false);
    socket.onopen = function () {
      reconnectAttempt = 0;
      showConnection("connected", true);
      resume();
    };
    socket.onmessage = function (event) {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch (err) {
        return; // not a frame of this protocol
      }
      if (frame && typeof frame === "object") onFrame(frame);
    };
    socket.onclose = function (event) {
      resuming = false;
      if ((event.code === 4401 || event.code === 4403) && (current || pending)) {
        // The server stopped the answer (kept); this page may not take it up again.
        if (current) {
          current.node.classList.remove("waiting", "reconnecting");
          fillMessage(current.node, { role: "assistant", content: current.text,
                                      status: "stopped" });
        }
        current = null;
        pending = false;
        setBusy(false);
      }
      // The server closes with 4401 or 4403 when the user may no longer chat here; it has
      // said why in an error frame just before (shown), else the page says it.
      if (event.code === 4401) {
        showConnection("signed out", false);
        if (!closingReason) showError("You are signed out. Sign in again to chat.");
        return;
      }
      if (event.code === 4403) {
        showConnection("no tenant", false);
        if (!closingReason) showError("Your account does not belong to an active tenant.");
        return;
      }
      closingReason = null;
      // The answer goes on in the server meanwhile, for a while: it is resumed on reconnect.
      reconnectLater();
    };
  }

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    const text = prompt.value;
    if (!text.trim() || current || pending) return;
    if (!socket || socket.readyState !== WebSocket.OPEN) {
      showError("Not connected to the server; retrying. Send again in a moment.");
      return;
    }
    messageNode({ role: "user", content: text, status: "complete" });
    scrollToEnd();
    socket.send(JSON.stringify({ type: "send", conversation_id: state.conversation_id,
                                 content: text }));
    prompt.value = "";
    pending = true;
    setBusy(true);
  });

  prompt.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  stopButton.addEventListener("click", function () {
    if (socket && socket.readyState === WebSocket.OPEN) {
      socket.send(JSON.stringify({ type: "stop" }));
    }
  });

  // Forms that ask before they post (no inline handlers: the page's policy forbids them).
  document.querySelectorAll("form[data-confirm]").forEach(function (node) {
    node.addEventListener("submit", function (event) {
      if (!window.confirm(node.dataset.confirm)) event.preventDefault();
    });
  });

  state.messages.forEach(function (message) { messageNode(message); });
  // A reloaded page whose last answer is still being written follows it again once connected.
  const last = state.messages[state.messages.length - 1];
  if (last && last.role === "assistant" && last.status === "streaming") {
    follow(last.id, nodeOf(last.id));
  }
  scrollToEnd();
  connect();
})();
