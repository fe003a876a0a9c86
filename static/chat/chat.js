// The chat page: renders the conversation, streams answers over the websocket, Stop.
// Model output is Markdown: marked turns it into HTML and DOMPurify keeps only inert Markdown
// before it enters the page: no script, and nothing that loads a resource by itself (an image
// becomes a link to it), styles the page (no style attribute or element, no class) or sends
// anything (no form or form control). The page's Content-Security-Policy blocks the same.
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
  let socket = null;
  let reconnectDelay = 500;
  let current = null; // {id, text, node} of the answer being written
  let pending = false; // a turn was sent and has not started or failed yet
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
    renderer: {
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

  function showConnection(text, ok) {
    connection.textContent = text;
    connection.classList.toggle("ok", !!ok);
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
        current = {
          id: frame.message_id, text: "",
          node: messageNode({ id: frame.message_id, role: "assistant", content: "",
                              status: "streaming" }),
        };
        current.node.classList.add("waiting");
        scrollToEnd();
        break;
      case "token":
        if (current && frame.message_id === current.id) {
          current.node.classList.remove("waiting");
          current.text += frame.text;
          scheduleRender();
        }
        break;
      case "done":
        if (current && frame.message_id === current.id) {
          current.node.classList.remove("waiting");
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
        showError(frame.message);
        if (!current) setBusy(false);
        break;
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + "/ws/chat/");
    showConnection("connecting…", false);
    socket.onopen = function () {
      reconnectDelay = 500;
      showConnection("connected", true);
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
      if (current || pending) {
        // The server aborts an answer whose socket closed; the stored text comes back on reload.
        if (current) {
          fillMessage(current.node, { role: "assistant", content: current.text,
                                      status: "stopped",
                                      error: "The connection was lost; the answer stopped." });
        } else {
          showError("The connection was lost before the answer started.");
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
      showConnection("disconnected, retrying…", false);
      setTimeout(connect, reconnectDelay);
      reconnectDelay = Math.min(reconnectDelay * 2, 10000);
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
  scrollToEnd();
  connect();
})();
