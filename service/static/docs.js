// /docs's only script of its own (no inline script: the page's CSP forbids it). Starts
// Swagger UI (swagger-ui-bundle.js, loaded before) on the description the page names.
"use strict";

(() => {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.getAttribute("data-openapi-url"),
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    // No validator badge: it would send the API description to validator.swagger.io.
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
