//! `PathTemplate`: a lock key built from a route's path parameters.

use std::fmt;

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
use http::request::Parts;
use lockingkit_tower::LockKey;

/// A lock key template over path parameters, such as `orders/{id}`.
///
/// `{name}` is replaced by the value of the route's path parameter `name`, percent-decoded as
/// axum's `Path` extractor sees it, so `/orders/42` and `/orders/%34%32` lock the same key.
/// `{*name}` also names the parameter of a wildcard route. Everything else is copied as is;
/// `{{` and `}}` stand for literal braces. The template is filled from the parameters of the
/// route that matched, so the layer belongs inside the router: `Router::route_layer`,
/// `Router::layer` or a method router's own `route_layer`.
///
/// A request that matched no route is not the template's business: it passes through unlocked,
/// so the router's fallback answers it (`404` stays `404`). A route that does not capture a
/// parameter the template names (`{Id}` on a route with `{id}`), and a layer outside the router
/// (it sees no route at all), are wiring mistakes in the server, not in the request: the layer
/// answers `500` with code `locking.misconfigured` and logs the mistake once, naming the
/// template, the route and the parameter.
#[derive(Clone, PartialEq, Eq)]
pub struct PathTemplate {
    source: Box<str>,
    pieces: Vec<Piece>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Literal(String),
    Param(String),
}

impl PathTemplate {
    /// Parses `template`. Parsing cannot fail: an unmatched `{` or `}` is literal text.
    pub fn new(template: &str) -> Self {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        for token in tokens(template) {
            match token {
                Token::Text(text) => literal.push_str(text),
                Token::Param(name) => {
                    if !literal.is_empty() {
                        pieces.push(Piece::Literal(std::mem::take(&mut literal)));
                    }
                    pieces.push(Piece::Param(name.to_owned()));
                }
            }
        }
        if !literal.is_empty() {
            pieces.push(Piece::Literal(literal));
        }
        PathTemplate {
            source: template.into(),
            pieces,
        }
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The parameter names the template uses, in order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|piece| match piece {
            Piece::Param(name) => Some(name.as_str()),
            Piece::Literal(_) => None,
        })
    }

    /// Fills the template from `param`, which looks a parameter up by name.
    ///
    /// Returns `Err` with the first parameter `param` does not know.
    pub fn render<'a>(
        &'a self,
        mut param: impl FnMut(&str) -> Option<&'a str>,
    ) -> Result<String, &'a str> {
        let mut key = String::with_capacity(self.source.len() + 16);
        for piece in &self.pieces {
            match piece {
                Piece::Literal(text) => key.push_str(text),
                Piece::Param(name) => key.push_str(param(name).ok_or(name.as_str())?),
            }
        }
        Ok(key)
    }
}

/// One token of a template, borrowed from it.
enum Token<'a> {
    /// Text copied as is: a run of text, an unmatched brace, or one brace of an escaped pair.
    Text(&'a str),
    /// A parameter's name, its wildcard `*` dropped.
    Param(&'a str),
}

/// The tokens of `template`: what [`PathTemplate::new`] parses, and what the wiring check scans
/// in place on every request.
fn tokens(template: &str) -> impl Iterator<Item = Token<'_>> {
    let mut rest = template;
    std::iter::from_fn(move || {
        let first = rest.chars().next()?;
        if rest.starts_with("{{") || rest.starts_with("}}") {
            let brace = &rest[..1];
            rest = &rest[2..];
            return Some(Token::Text(brace));
        }
        if let Some((name, after)) = rest
            .strip_prefix('{')
            .and_then(|open| open.split_once('}'))
            .filter(|(name, _)| is_param_name(name))
        {
            rest = after;
            return Some(Token::Param(name.strip_prefix('*').unwrap_or(name)));
        }
        // Text up to the next brace; a brace here is an unmatched one, copied as text.
        let start = first.len_utf8();
        let end = rest[start..]
            .find(['{', '}'])
            .map_or(rest.len(), |at| start + at);
        let (text, after) = rest.split_at(end);
        rest = after;
        Some(Token::Text(text))
    })
}

/// The parameter names of `template`, in order, borrowed from it.
fn param_names(template: &str) -> impl Iterator<Item = &str> {
    tokens(template).filter_map(|token| match token {
        Token::Param(name) => Some(name),
        Token::Text(_) => None,
    })
}

/// A name axum would accept inside braces: non-empty, optionally starting with `*`, and free
/// of braces and slashes.
fn is_param_name(name: &str) -> bool {
    let bare = name.strip_prefix('*').unwrap_or(name);
    !bare.is_empty() && !bare.contains(['{', '}', '/', '*'])
}

/// The path parameters axum stored when it routed the request.
///
/// Extracting `RawPathParams` only reads the request extensions, but its signature is async,
/// so it is awaited like any extractor: the layer's response future waits for it.
async fn raw_path_params(request: &mut Parts) -> Result<RawPathParams, RawPathParamsRejection> {
    <RawPathParams as FromRequestParts<()>>::from_request_parts(request, &()).await
}

impl LockKey for PathTemplate {
    async fn applies_to(&self, request: &mut Parts) -> bool {
        // axum stores path parameters (perhaps none) on every request it routes, fallbacks
        // included, but a `MatchedPath` only when a route matched. Parameters without a matched
        // path mean the request is bound for a fallback, whose answer a lock layer must not
        // change (404 stays 404), whether the layer came with `Router::layer`, `merge` or
        // `nest`. A request without parameters was never routed: the layer sits outside the
        // router, and it is refused rather than quietly served unlocked.
        request.extensions.get::<MatchedPath>().is_some()
            || matches!(
                raw_path_params(request).await,
                Err(RawPathParamsRejection::MissingPathParams(_))
            )
    }

    async fn miswired(&self, request: &mut Parts) -> Option<String> {
        let Some(route) = request.extensions.get::<MatchedPath>() else {
            // `applies_to` let through only requests that were never routed.
            return Some(format!(
                "the lock key template `{}` sees no route: add its layer inside the router \
                 (Router::route_layer, Router::layer or a method router's route_layer)",
                self.source
            ));
        };
        // Asked on every request, so the route is scanned in place, with no template built.
        let missing = self
            .params()
            .find(|name| !param_names(route.as_str()).any(|captured| captured == *name))?;
        Some(format!(
            "the lock key template `{}` names the path parameter `{missing}`, which the route \
             `{}` does not capture",
            self.source,
            route.as_str()
        ))
    }

    async fn lock_key(&self, request: &mut Parts) -> Option<String> {
        // `miswired` has made sure the route captures every parameter the template names.
        let params = raw_path_params(request).await.ok()?;
        self.render(|name| {
            params
                .iter()
                .find_map(|(param, value)| (param == name).then_some(value))
        })
        .ok()
    }
}

impl fmt::Debug for PathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PathTemplate").field(&self.source).finish()
    }
}

impl fmt::Display for PathTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn render(template: &str, params: &[(&str, &str)]) -> Result<String, String> {
        let template = PathTemplate::new(template);
        template
            .render(|name| {
                params
                    .iter()
                    .find_map(|(param, value)| (*param == name).then_some(*value))
            })
            .map_err(str::to_owned)
    }

    #[test]
    fn params_are_replaced_by_their_values() {
        assert_eq!(render("orders/{id}", &[("id", "42")]).unwrap(), "orders/42");
        assert_eq!(
            render("t/{tenant}/o/{id}", &[("id", "7"), ("tenant", "acme")]).unwrap(),
            "t/acme/o/7"
        );
        assert_eq!(
            render("files/{*path}", &[("path", "a/b")]).unwrap(),
            "files/a/b"
        );
        assert_eq!(render("{id}", &[("id", "x")]).unwrap(), "x");
    }

    #[test]
    fn a_missing_param_is_named() {
        assert_eq!(render("orders/{id}", &[("order", "1")]).unwrap_err(), "id");
    }

    #[test]
    fn braces_that_are_not_params_stay_literal() {
        assert_eq!(render("a{{b}}c", &[]).unwrap(), "a{b}c");
        assert_eq!(render("open{", &[]).unwrap(), "open{");
        assert_eq!(render("close}", &[]).unwrap(), "close}");
        assert_eq!(render("empty{}", &[]).unwrap(), "empty{}");
        assert_eq!(render("slash{a/b}", &[]).unwrap(), "slash{a/b}");
        let template = PathTemplate::new("x/{a}/{*b}/{c}");
        assert_eq!(template.params().collect::<Vec<_>>(), ["a", "b", "c"]);
    }

    #[test]
    fn scanning_in_place_finds_each_param_once_and_no_escaped_brace() {
        let cases: [(&str, &[&str]); 10] = [
            ("orders/{id}", &["id"]),
            ("t/{tenant}/o/{*rest}", &["tenant", "rest"]),
            ("a{{b}}c/{x}", &["x"]),
            ("{{{y}}}", &["y"]),
            ("open{/{z}", &["z"]),
            ("close}/{w}", &["w"]),
            ("empty{}/{v}", &["v"]),
            ("slash{a/b}/{u}", &["u"]),
            ("{a}{b}", &["a", "b"]),
            ("", &[]),
        ];
        for (template, expected) in cases {
            assert_eq!(
                param_names(template).collect::<Vec<_>>(),
                expected,
                "{template}"
            );
            let parsed = PathTemplate::new(template);
            assert_eq!(parsed.params().collect::<Vec<_>>(), expected, "{template}");
        }
    }

    proptest! {
        #[test]
        fn scanning_agrees_with_parsing_on_any_text(template in "[a-c{}*/]{0,16}") {
            let parsed: Vec<String> =
                PathTemplate::new(&template).params().map(str::to_owned).collect();
            let scanned: Vec<String> = param_names(&template).map(str::to_owned).collect();
            prop_assert_eq!(scanned, parsed);
        }


        #[test]
        fn rendering_round_trips_any_values(
            literals in proptest::collection::vec("[^{}]{0,8}", 1..5),
            values in proptest::collection::vec("\\PC{0,12}", 4),
        ) {
            // Interleave literals with params p0, p1, …: the result must be the same
            // interleaving with the values substituted verbatim.
            let mut template = String::new();
            let mut expected = String::new();
            for (i, literal) in literals.iter().enumerate() {
                template.push_str(literal);
                expected.push_str(literal);
                if i < values.len() {
                    template.push_str(&format!("{{p{i}}}"));
                    expected.push_str(&values[i]);
                }
            }
            let names: Vec<String> = (0..values.len()).map(|i| format!("p{i}")).collect();
            let params: Vec<(&str, &str)> = names
                .iter()
                .map(String::as_str)
                .zip(values.iter().map(String::as_str))
                .collect();
            prop_assert_eq!(render(&template, &params).unwrap(), expected);
        }
    }
}
