//! Chat templates: the checkpoint's own Jinja template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`) rendered with minijinja the way transformers
//! renders it (trim_blocks, lstrip_blocks, Python string methods), or a ChatML fallback.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// One chat message. `reasoning_content` is the thinking part of an earlier assistant turn,
/// when the client keeps it apart from `content`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into(), reasoning_content: None }
    }
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    /// Where the template came from (a file, "built-in Qwen3.5", "ChatML fallback").
    pub origin: String,
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
        env.add_template_owned("chat", source).with_context(|| format!("{origin}: the chat template does not parse"))?;
        Ok(ChatTemplate { env, origin })
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
        if messages.is_empty() {
            bail!("a chat needs at least one message");
        }
        let tmpl = self.env.get_template("chat")?;
        tmpl.render(minijinja::context! {
            messages => messages,
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
}
