//! A small command-line parser: `--name value`, `--name=value` and boolean `--flag`s, with
//! errors that name the flag. (Enough for tandem's subcommands without a parser dependency.)

use std::collections::HashMap;
use std::str::FromStr;

use anyhow::{bail, Context, Result};

pub struct Args {
    values: HashMap<String, Vec<String>>,
    flags: Vec<String>,
}

impl Args {
    /// Parse `argv` given the names of the options that take a value and of the boolean flags.
    pub fn parse(argv: &[String], with_value: &[&str], booleans: &[&str]) -> Result<Args> {
        Self::parse_with_lists(argv, with_value, &[], booleans)
    }

    /// Like `parse`, where the options named in `lists` may be given more than once.
    pub fn parse_with_lists(argv: &[String], with_value: &[&str], lists: &[&str], booleans: &[&str]) -> Result<Args> {
        let mut values = HashMap::new();
        let mut flags = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?} (options start with --; see --help)");
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if with_value.contains(&name) || lists.contains(&name) {
                let v = match inline {
                    Some(v) => v,
                    None => it.next().with_context(|| format!("--{name} needs a value"))?.clone(),
                };
                let given: &mut Vec<String> = values.entry(name.to_string()).or_default();
                if !given.is_empty() && !lists.contains(&name) {
                    bail!("--{name} given twice");
                }
                given.push(v);
            } else if booleans.contains(&name) {
                if inline.is_some() {
                    bail!("--{name} takes no value");
                }
                flags.push(name.to_string());
            } else {
                bail!("unknown option --{name} (see --help)");
            }
        }
        Ok(Args { values, flags })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).and_then(|v| v.first()).map(String::as_str)
    }

    /// Every value of a list option, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.values.get(name).map(|v| v.iter().map(String::as_str).collect()).unwrap_or_default()
    }

    pub fn required(&self, name: &str) -> Result<&str> {
        self.str(name).with_context(|| format!("--{name} is required"))
    }

    /// A parsed value, or `default` when the option is absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.str(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| anyhow::anyhow!("--{name} {v:?} is not a valid {}", std::any::type_name::<T>())),
        }
    }
}
