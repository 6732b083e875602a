//! Chat templates: the checkpoint's own Jinja template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`) rendered with minijinja the way transformers
//! renders it (trim_blocks, lstrip_blocks, Python string methods), or a ChatML fallback.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// One chat message. `reasoning_content` is the thinking part of an earlier assistant turn,
/// when the client keeps it apart from `content`; `tool_calls` an assistant turn's calls as the
/// templates read them (OpenAI's `{"id", "type", "function": {"name", "arguments"}}` with the
/// arguments an object, not the JSON text the API carries); `tool_call_id` the call a tool
/// message answers.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into(), reasoning_content: None, tool_calls: None, tool_call_id: None }
    }
}

/// `value` as Python's `json.dumps` writes it with transformers' `tojson` (", " and ": " between
/// items, non-ASCII characters as they are, keys in the order given): the chat templates write
/// tool schemas and arguments with it, and a prompt must be the bytes the model was trained on.
pub fn python_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write(item, out);
                }
                out.push(']');
            }
            Value::Object(map) => {
                out.push('{');
                for (i, (k, item)) in map.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push_str(": ");
                    write(item, out);
                }
                out.push('}');
            }
            // Scalars as serde_json writes them: Python's escapes for strings (ensure_ascii off).
            scalar => out.push_str(&scalar.to_string()),
        }
    }
    let mut out = String::new();
    write(value, &mut out);
    out
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    /// Where the template came from (a file, "built-in Qwen3.5", "ChatML fallback").
    pub origin: String,
    /// The template's Jinja text.
    pub source: String,
}

/// ChatML, for checkpoints that ship no template.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The Qwen3.5 conversation format (docs/qwen35.md §4), written for tandem's synthetic models,
/// which have no checkpoint to carry a template. Real checkpoints use their own.
pub const QWEN35_TEMPLATE: &str = include_str!("../../../assets/qwen3.5/chat_template.jinja");

impl ChatTemplate {
    pub fn new(source: String, origin: String) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        // transformers' tojson (Python's json.dumps), not minijinja's (which escapes for HTML).
        env.add_filter("tojson", |v: minijinja::Value| -> Result<minijinja::Value, minijinja::Error> {
            let json = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
            Ok(minijinja::Value::from_safe_string(python_json(&json)))
        });
        env.add_template_owned("chat", source.clone()).with_context(|| format!("{origin}: the chat template does not parse"))?;
        Ok(ChatTemplate { env, origin, source })
    }

    pub fn chatml() -> Self {
        Self::new(CHATML.into(), "ChatML fallback".into()).expect("built-in ChatML template parses")
    }

    pub fn qwen35() -> Self {
        Self::new(QWEN35_TEMPLATE.into(), "built-in Qwen3.5 template".into()).expect("built-in Qwen3.5 template parses")
    }

    /// The template a checkpoint directory carries, if any.
    pub fn from_checkpoint(dir: &Path) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let text = std::fs::read_to_string(&jinja).with_context(|| format!("reading {}", jinja.display()))?;
            return Self::new(text, jinja.display().to_string()).map(Some);
        }
        let cfg = dir.join("tokenizer_config.json");
        if cfg.exists() {
            let text = std::fs::read_to_string(&cfg).with_context(|| format!("reading {}", cfg.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", cfg.display()))?;
            let template = match v.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default".
                Some(serde_json::Value::Array(items)) => items
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(String::from),
                _ => None,
            };
            if let Some(t) = template {
                return Self::new(t, format!("{} (chat_template)", cfg.display())).map(Some);
            }
        }
        Ok(None)
    }

    /// Render a conversation. With `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool, enable_thinking: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt, enable_thinking)
    }

    /// `render` with the functions the model may call (OpenAI's `tools` list, as the client
    /// gave it), which the template lists in the prompt.
    pub fn render_with_tools(&self, messages: &[Message], tools: Option<&serde_json::Value>, add_generation_prompt: bool, enable_thinking: bool) -> Result<String> {
        if messages.is_empty() {
            bail!("a chat needs at least one message");
        }
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            enable_thinking => enable_thinking,
        })
        .with_context(|| format!("rendering the chat template ({})", self.origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation() -> Vec<Message> {
        vec![
            Message::new("system", "You are terse."),
            Message::new("user", "Hi"),
            Message::new("assistant", "<think>\nGreet back.\n</think>\n\nHello!"),
            Message::new("user", "2+2?"),
        ]
    }

    #[test]
    fn multi_turn_qwen35_rendering() {
        let t = ChatTemplate::qwen35();
        let no_think = t.render(&conversation(), true, false).unwrap();
        assert_eq!(
            no_think,
            "<|im_start|>system\nYou are terse.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
        let think = t.render(&conversation(), true, true).unwrap();
        assert!(think.ends_with("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"), "{think}");
    }

    #[test]
    fn reasoning_after_the_last_user_turn_is_kept() {
        let mut msgs = conversation();
        msgs.push(Message {
            role: "assistant".into(),
            content: "4".into(),
            reasoning_content: Some("Add them.".into()),
            ..Message::new("assistant", "")
        });
        let s = ChatTemplate::qwen35().render(&msgs, false, true).unwrap();
        assert!(s.ends_with("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n"), "{s}");
        // The earlier turn, before the last user message, lost its reasoning.
        assert!(s.contains("<|im_start|>assistant\nHello!<|im_end|>"));
    }

    #[test]
    fn chatml_fallback_and_template_errors() {
        let s = ChatTemplate::chatml().render(&[Message::new("user", "x")], true, false).unwrap();
        assert_eq!(s, "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
        assert!(ChatTemplate::new("{% for %}".into(), "bad.jinja".into()).is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}".into(), "t".into()).unwrap();
        let err = format!("{:#}", t.render(&[Message::new("user", "x")], true, false).unwrap_err());
        assert!(err.contains("no system role"), "{err}");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let v: serde_json::Value = serde_json::from_str(r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": {"city <&>": "Zürich \"x\"\n"}}"#).unwrap();
        // Keys in the order given, Python's separators, nothing escaped for HTML.
        assert_eq!(python_json(&v), r#"{"name": "get_weather", "b": [1, 2.5, true, null], "a": {"city <&>": "Zürich \"x\"\n"}}"#);
    }

    #[test]
    fn tools_and_tool_calls_render_in_the_qwen35_format() {
        let tools: serde_json::Value = serde_json::from_str(r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]"#).unwrap();
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "units": ["C"]}}}]));
        let mut result = Message::new("tool", "18 C");
        result.tool_call_id = Some("call_1".into());
        let msgs = vec![Message::new("system", "Be brief."), Message::new("user", "Weather in Paris?"), call, result];
        let s = ChatTemplate::qwen35().render_with_tools(&msgs, Some(&tools), true, false).unwrap();
        assert!(s.starts_with("<|im_start|>system\n# Tools\n\n"), "{s}");
        assert!(s.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\""), "{s}");
        assert!(s.contains("</tool_call>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"), "{s}");
        assert!(s.contains("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=units>\n[\"C\"]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"), "{s}");
        assert!(s.ends_with("<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{s}");
        // Without tools, the system turn is the system message alone.
        let plain = ChatTemplate::qwen35().render(&msgs[..2], true, false).unwrap();
        assert!(plain.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"), "{plain}");
    }
}
